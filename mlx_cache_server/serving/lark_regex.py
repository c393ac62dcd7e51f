"""A custom tool's Lark grammar as one regular expression, so it can be enforced.

A custom tool's input travels inside the call's JSON, as a string; llguidance
can hold a JSON string to a regular expression (it escapes the expression
itself), not to a context-free grammar. Most tool grammars are regular in fact:
Codex's `apply_patch` is rules that refer to rules, never back to themselves.
Such a grammar is inlined, rule by rule, into one expression; a grammar that
recurses, ignores terminals between others (`%ignore`) or uses llguidance's own
extensions is not regular here, and `NotRegular` says why.

Expressions are written in the Rust `regex` dialect llguidance reads; a Lark
regex literal is passed through as it is (OpenAI's custom tools use the same
dialect).
"""

from __future__ import annotations

import ast
import re
from typing import Any

MAX_CHARS = 50_000  # inlining repeats a rule at each use: a bound on the expression
# Bounds on what is read at all, checked as it is read: the work of every step below is
# linear in the grammar's size, and these keep that size, and the recursion of the rule
# parser and the inliner, well inside what a request may cost.
MAX_DEFINITION = 100_000  # characters of a grammar
MAX_RULES = 1_000
MAX_NESTING = 50  # brackets inside brackets in one rule, and rules inside rules when inlined

# Lark's `common` terminals, as llguidance defines them.
COMMON = {
    "LF": r"\n", "CR": r"\r", "NEWLINE": r"(?:\r?\n)+", "WS": r"[ \t\f\r\n]+",
    "WS_INLINE": r"[ \t]+", "DIGIT": r"[0-9]", "HEXDIGIT": r"[a-fA-F0-9]", "INT": r"[0-9]+",
    "SIGNED_INT": r"[+\-]?[0-9]+", "DECIMAL": r"(?:[0-9]+\.[0-9]*|\.[0-9]+)",
    "FLOAT": r"(?:(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][+\-]?[0-9]+)?|[0-9]+[eE][+\-]?[0-9]+)",
    "NUMBER": r"(?:[0-9]+|(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][+\-]?[0-9]+)?|[0-9]+[eE][+\-]?[0-9]+)",
    "LCASE_LETTER": r"[a-z]", "UCASE_LETTER": r"[A-Z]", "LETTER": r"[A-Za-z]",
    "WORD": r"[A-Za-z]+", "CNAME": r"[_A-Za-z][_A-Za-z0-9]*",
    "ESCAPED_STRING": r'"(?:[^"\\]|\\.)*"', "SH_COMMENT": r"#[^\n]*",
    "CPP_COMMENT": r"//[^\n]*",
}  # fmt: skip
COMMON["SIGNED_FLOAT"] = r"[+\-]?" + COMMON["FLOAT"]
COMMON["SIGNED_NUMBER"] = r"[+\-]?" + COMMON["NUMBER"]

_TOKEN = re.compile(
    r"""(?P<skip>[ \t\r]+|//[^\n]*|\\\n)
      | (?P<nl>\n)
      | (?P<string>"(?:\\.|[^"\\\n])*"i?)
      | (?P<regex>/(?:\\.|[^/\\\n])+/[imslux]*)
      | (?P<directive>%[a-z]+)
      | (?P<name>[?!]?[_A-Za-z][_A-Za-z0-9]*(?:\.[_A-Za-z0-9]+)*)
      | (?P<number>[0-9]+)
      | (?P<op>->|\.\.|[:|()\[\]?*+~,])
    """,
    re.VERBOSE,
)
_META = set(r"\.+*?()|[]{}^$#&-~")


class NotRegular(ValueError):
    """The grammar cannot be written as one regular expression here; the message says why."""


def lark_to_regex(definition: str) -> str:
    """The language of the Lark grammar `definition` (from its `start` rule) as a regex;
    NotRegular, and nothing else, for any grammar that cannot be (malformed ones too)."""
    if len(definition) > MAX_DEFINITION:
        raise NotRegular(f"the grammar is over {MAX_DEFINITION} characters")
    try:
        rules = _rules(_statements(_tokens(definition)))
        if "start" not in rules:
            raise NotRegular("the grammar has no 'start' rule")
        return _Inliner(rules).regex("start")
    except NotRegular:
        raise
    except (ValueError, SyntaxError, IndexError, KeyError, TypeError, RecursionError) as e:
        # What the bounds and checks above missed is still a grammar read wrong, not a
        # fault of the server's.
        raise NotRegular(f"cannot read the grammar: {type(e).__name__}") from e


def _tokens(text: str) -> list[tuple[str, str]]:
    out, at = [], 0
    while at < len(text):
        found = _TOKEN.match(text, at)
        if found is None:
            raise NotRegular(f"cannot read the grammar at {text[at : at + 20]!r}")
        kind = found.lastgroup or ""
        if kind == "directive" and found.group() != "%import":
            raise NotRegular(f"{found.group()} is not supported in a tool's grammar")
        if kind != "skip":
            out.append((kind, found.group()))
        at = found.end()
    return out


def _statements(tokens: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """Tokens by statement: a new line ends one unless the next line goes on with `|`.
    One pass: whether a line break ends a statement is decided by the token after it."""
    out: list[list[tuple[str, str]]] = [[]]
    broken = False
    for token in tokens:
        if token[0] == "nl":
            broken = True
            continue
        if broken and token != ("op", "|"):
            out.append([])
        broken = False
        out[-1].append(token)
    statements = [s for s in out if s]
    if len(statements) > MAX_RULES:
        raise NotRegular(f"the grammar has over {MAX_RULES} statements")
    return statements


def _rules(statements: list[list[tuple[str, str]]]) -> dict[str, Any]:
    rules: dict[str, Any] = {}
    for statement in statements:
        kind, text = statement[0]
        if kind == "directive":  # %import: the others are refused when read
            rules.update(_imports(statement[1:]))
            continue
        if kind != "name" or len(statement) < 2 or statement[1] != ("op", ":"):
            raise NotRegular(f"expected 'name: ...', got {text!r}")
        name = text.lstrip("?!").split(".")[0]  # modifiers and priority change no language
        parser = _Parser(statement[2:])
        rules[name] = parser.expansions()
        if parser.at < len(parser.tokens):
            raise NotRegular(f"cannot read rule {name!r} at {parser.tokens[parser.at][1]!r}")
    return rules


def _imports(tokens: list[tuple[str, str]]) -> dict[str, Any]:
    words = [text for _, text in tokens]
    if not words or not words[0].startswith("common"):
        raise NotRegular("only %import common.NAME is supported")
    if words[0] == "common" and words[1:2] == ["("]:
        names = [(w, w) for w in words[2:] if w not in (",", ")")]
    else:
        name = words[0].removeprefix("common.")
        alias = words[2] if words[1:2] == ["->"] else name
        names = [(name, alias)]
    out = {}
    for name, alias in names:
        if name not in COMMON:
            raise NotRegular(f"common.{name} is not known here")
        out[alias] = ("re", COMMON[name])
    return out


class _Parser:
    """Recursive descent over one rule's tokens: alternatives of sequences of atoms."""

    def __init__(self, tokens: list[tuple[str, str]]) -> None:
        self.tokens, self.at, self.depth = tokens, 0, 0

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def take(self) -> tuple[str, str]:
        if self.at >= len(self.tokens):
            raise NotRegular("a rule ends where it needs more")
        self.at += 1
        return self.tokens[self.at - 1]

    def count(self) -> int:
        kind, text = self.take()
        if kind != "number":
            raise NotRegular(f"expected a count after '~', got {text!r}")
        return int(text)

    def expansions(self) -> Any:
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise NotRegular(f"a rule nests brackets over {MAX_NESTING} deep")
        options = [self.sequence()]
        while self.peek() == ("op", "|"):
            self.take()
            options.append(self.sequence())
        self.depth -= 1
        return ("alt", options)

    def sequence(self) -> Any:
        items = []
        while (token := self.peek()) is not None and token[1] not in ("|", ")", "]"):
            if token == ("op", "->"):  # an alias names the tree's node, not the language
                self.take()
                self.take()
                continue
            items.append(self.repeated(self.atom()))
        return ("seq", items)

    def repeated(self, item: Any) -> Any:
        token = self.peek()
        if token in (("op", "?"), ("op", "*"), ("op", "+")):
            self.take()
            return ("rep", item, *{"?": (0, 1), "*": (0, None), "+": (1, None)}[token[1]])
        if token == ("op", "~"):
            self.take()
            low = high = self.count()
            if self.peek() == ("op", ".."):
                self.take()
                high = self.count()
            if high < low:
                raise NotRegular(f"a repetition ~{low}..{high} admits nothing")
            return ("rep", item, low, high)
        return item

    def atom(self) -> Any:
        kind, text = self.take()
        if kind == "string":
            value, fold = _string(text)
            if self.peek() == ("op", ".."):
                self.take()
                kind, text = self.take()
                if kind != "string":
                    raise NotRegular(f"a range ends with a string, not {text!r}")
                end, _ = _string(text)
                return ("re", f"[{_char(value)}-{_char(end)}]")
            return ("re", f"(?i:{_escape(value)})" if fold else _escape(value))
        if kind == "regex":
            body, flags = text[1:].rsplit("/", 1)
            if "l" in flags:
                raise NotRegular("the regex flag 'l' is not supported")
            return ("re", f"(?{flags}:{body})" if flags else f"(?:{body})")
        if kind == "name":
            return ("ref", text)
        if text in ("(", "["):
            inner = self.expansions()
            close = self.take()[1] if self.peek() else None
            if close != {"(": ")", "[": "]"}[text]:
                raise NotRegular(f"unclosed {text!r}")
            return inner if text == "(" else ("rep", inner, 0, 1)
        raise NotRegular(f"unexpected {text!r}")


def _string(token: str) -> tuple[str, bool]:
    fold = token.endswith("i")
    try:
        value = ast.literal_eval(token[:-1] if fold else token)
    except (ValueError, SyntaxError) as e:
        raise NotRegular(f"cannot read the string {token[:40]!r}") from e
    if not isinstance(value, str):
        raise NotRegular(f"{token[:40]!r} is not a string")
    return value, fold


def _char(value: str) -> str:
    if len(value) != 1:
        raise NotRegular(f"a range needs single characters, got {value!r}")
    return _escape(value)


def _escape(text: str) -> str:
    out = []
    for c in text:
        if c in _META or c == " ":
            out.append("\\" + c if c != " " else " ")
        elif c.isprintable():
            out.append(c)
        else:  # a form both Rust's and Python's regexes read
            out.append(f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\U{ord(c):08x}")
    return "".join(out)


class _Inliner:
    """Rules written out in place; a rule met again inside itself is recursion."""

    def __init__(self, rules: dict[str, Any]) -> None:
        self.rules, self.done, self.open = rules, {}, set()

    def regex(self, name: str) -> str:
        if name in self.done:
            return self.done[name]
        if name not in self.rules:
            raise NotRegular(f"{name!r} is used but not defined")
        if name in self.open:
            raise NotRegular(f"rule {name!r} refers to itself")
        if len(self.open) >= MAX_NESTING:
            raise NotRegular(f"rules refer to rules over {MAX_NESTING} deep")
        self.open.add(name)
        self.done[name] = f"(?:{self.node(self.rules[name])})"
        self.open.discard(name)
        if len(self.done[name]) > MAX_CHARS:
            raise NotRegular(f"inlined, the grammar is over {MAX_CHARS} characters")
        return self.done[name]

    def node(self, node: Any) -> str:
        kind = node[0]
        if kind == "alt":
            return _joined("|", (self.node(option) for option in node[1]))
        if kind == "seq":
            return _joined("", (f"(?:{self.node(item)})" if item[0] == "alt" else self.node(item)
                                for item in node[1]))  # fmt: skip
        if kind == "re":
            return node[1]
        if kind == "ref":
            return self.regex(node[1])
        low, high = node[2], node[3]
        count = {(0, 1): "?", (0, None): "*", (1, None): "+"}.get((low, high))
        if count is None:
            count = f"{{{low},{'' if high is None else high}}}"
        return f"(?:{self.node(node[1])}){count}"


def _joined(separator: str, parts: Any) -> str:
    """`separator.join(parts)`, stopped as soon as it is over `MAX_CHARS`: a rule used many
    times in one rule would otherwise be written out in full before its size is checked."""
    out, size = [], 0
    for part in parts:
        size += len(part) + len(separator)
        if size > MAX_CHARS:
            raise NotRegular(f"inlined, the grammar is over {MAX_CHARS} characters")
        out.append(part)
    return separator.join(out)
