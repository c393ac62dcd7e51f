"""A custom tool's Lark grammar as one regex: the language kept, recursion refused, and the
pattern held inside the call's JSON string by llguidance."""

from __future__ import annotations

import json
import re

import llguidance
import llguidance.hf
import pytest
from transformers import PreTrainedTokenizerFast

from mlx_cache_server.serving.lark_regex import NotRegular, lark_to_regex
from mlx_cache_server.serving.responses_input import _custom_parameters
from tests.tiny_model import build_tokenizer

# Codex CLI 0.171's apply_patch grammar, as it sends it.
APPLY_PATCH = r"""start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?

hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?

filename: /(.+)/
add_line: "+" /(.*)/ LF -> line

change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF

%import common.LF
"""
PATCHES = [
    "*** Begin Patch\n*** Add File: a.py\n+print('hi')\n+\n*** End Patch\n",
    "*** Begin Patch\n*** Delete File: old.txt\n*** End Patch",
    "*** Begin Patch\n*** Update File: src/x.py\n*** Move to: src/y.py\n@@ def f():\n"
    '-    return "a\\tb"\n+    return 1\n \tkept\n*** End of File\n*** End Patch\n',
    "*** Begin Patch\n*** Update File: é.md\n@@\n-x\n+y\n*** Add File: b\n+z\n*** End Patch\n",
]
NOT_PATCHES = [
    "",
    "*** Begin Patch\n*** End Patch\n",  # no hunk
    "*** Begin Patch\n*** Add File: a.py\n*** End Patch\n",  # an added file with no line
    "*** Begin Patch\n*** Update File: a\n*x\n*** End Patch\n",  # a change line's first char
    "*** Begin Patch\n*** Delete File: a\n",  # not ended
    "*** Begin Patch\n*** Delete File: \n*** End Patch\n",  # no name
    "Begin Patch\n*** Delete File: a\n*** End Patch\n",
]


@pytest.mark.parametrize("text", PATCHES)
def test_the_apply_patch_regex_takes_every_patch(text):
    assert re.fullmatch(lark_to_regex(APPLY_PATCH), text)


@pytest.mark.parametrize("text", NOT_PATCHES)
def test_the_apply_patch_regex_takes_nothing_else(text):
    assert not re.fullmatch(lark_to_regex(APPLY_PATCH), text)


@pytest.mark.parametrize(
    ("grammar", "yes", "no"),
    [
        ('start: "a" ("b" | "c")* "d"', ["ad", "abcbd"], ["a", "abd "]),
        ('start: x ~ 2..3\nx: "ab"', ["abab", "ababab"], ["ab", "abababab"]),
        ('start: "x" ["y"] Z\nZ: "0".."9"', ["x1", "xy9"], ["xya", "x"]),
        ('start: "hi"i WS? /[0-9]+/\n%import common.WS', ["HI 12", "hI7"], ["hi"]),
        ('start: a\n    | b\na: "1"\nb: N\n%import common.INT -> N', ["1", "42"], ["a"]),
        ("start: WORD WS WORD\n%import common (WORD, WS)", ["ab  cd"], ["ab", "a1 b"]),
        ('start: A\n   | B  // two lines\nA: "a"\nB: "b"', ["a", "b"], ["ab"]),
        ('?start.2: n -> num\n!n: "(" /[a-z.]+/ ")"', ["(a.b)"], ["()", "(A)"]),
        ('start: "\\"q\\"\\\\\\n"', ['"q"\\\n'], ['"q"']),
    ],
)
def test_lark_constructs_keep_their_language(grammar, yes, no):
    pattern = lark_to_regex(grammar)
    for text in yes:
        assert re.fullmatch(pattern, text), (grammar, text)
    for text in no:
        assert not re.fullmatch(pattern, text), (grammar, text)


@pytest.mark.parametrize(
    ("grammar", "why"),
    [
        ('start: "(" start ")" | "x"', "refers to itself"),
        ("start: a\na: b\nb: a", "refers to itself"),
        ('start: "x"\n%ignore " "', "%ignore"),
        ('start: %json {"type": "string"}', "%json"),
        ("start: X\n%import common.NOPE", "NOPE"),
        ('a: "x"', "no 'start'"),
        ("start: missing", "not defined"),
        ('start: ("x"', "unclosed"),
        (
            "start: a a a a a a a a\na: b b b b b b b b\nb: c c c c c c c c\n"
            'c: d d d d d d d d\nd: "xxxxxxxxxx"',
            "over",
        ),  # fmt: skip
    ],
)
def test_what_is_not_regular_says_why(grammar, why):
    with pytest.raises(NotRegular, match=why):
        lark_to_regex(grammar)


@pytest.fixture(scope="module")
def byte_tokenizer():
    hf = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer())
    return hf, llguidance.hf.from_tokenizer(hf)


def _accepts(byte_tokenizer, grammar: str, text: str) -> bool:
    hf, tokenizer = byte_tokenizer
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    ids = hf.encode(text)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def test_the_call_json_holds_the_patch_escaped_and_nothing_else(byte_tokenizer):
    tool = {"type": "custom", "name": "apply_patch",
            "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH}}  # fmt: skip
    schema = _custom_parameters(tool, "apply_patch", "tools[0]")
    assert "pattern" in schema["properties"]["input"]
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False}
    )

    def call(text: str) -> str:
        return json.dumps({"input": text}, ensure_ascii=False, separators=(",", ":"))

    for text in PATCHES:
        assert _accepts(byte_tokenizer, grammar, call(text)), text
    for text in NOT_PATCHES:
        assert not _accepts(byte_tokenizer, grammar, call(text)), text
    raw_newline = '{"input":"*** Begin Patch\n*** Delete File: a\n*** End Patch"}'
    assert not _accepts(byte_tokenizer, grammar, raw_newline)


@pytest.mark.parametrize(
    "spec",
    [
        {"type": "grammar", "syntax": "lark", "definition": 'start: "(" start ")" | "x"'},
        {"type": "grammar", "syntax": "regex", "definition": "(?<=a)b"},  # not Rust's dialect
        {"type": "text"},
    ],
)
def test_a_grammar_that_cannot_be_held_leaves_the_string_free(spec):
    tool = {"type": "custom", "name": "t", "format": spec}
    schema = _custom_parameters(tool, "t", "tools[0]")
    assert schema["properties"]["input"] == {"type": "string"}


def test_a_regex_format_is_held_as_it_is():
    tool = {"type": "custom", "name": "t",
            "format": {"type": "grammar", "syntax": "regex", "definition": "[a-z]+"}}  # fmt: skip
    schema = _custom_parameters(tool, "t", "tools[0]")
    assert schema["properties"]["input"]["pattern"] == "^(?:[a-z]+)$"


# Grammars a hostile client sent (issue 55): each escaped `except NotRegular` as a 500.
MALFORMED = [
    'start: "a"~',  # a count that never comes
    'start: "a"~x',
    'start: "a"~3..',
    'start: "a"~5..2',
    'start: "\\x"',  # a string Python cannot read
    'start: "a"..',  # a range with no end
    'start: "a".."bc"',
    "start: " + "(" * 5_000 + '"a"' + ")" * 5_000,  # past Python's recursion limit
    "start: r0\n" + "".join(f'r{i}: "x" r{i + 1}\n' for i in range(2_000)) + 'r2000: "e"\n',
    "start: (",
    "start: [",
    "start: ->",
]


@pytest.mark.parametrize("grammar", MALFORMED, ids=range(len(MALFORMED)))
def test_a_malformed_grammar_is_not_regular_never_another_error(grammar):
    with pytest.raises(NotRegular):
        lark_to_regex(grammar)


@pytest.mark.parametrize("grammar", MALFORMED[:3], ids=range(3))
def test_a_malformed_grammar_leaves_the_string_free(grammar):
    tool = {"type": "custom", "name": "t",
            "format": {"type": "grammar", "syntax": "lark", "definition": grammar}}  # fmt: skip
    schema = _custom_parameters(tool, "t", "tools[0]")
    assert schema["properties"]["input"] == {"type": "string"}


class _CountingList(list):
    """A token list that counts the elements its slices copy: the old statement split
    copied the rest of the grammar at every line break."""

    copied = 0

    def __getitem__(self, index):
        out = super().__getitem__(index)
        if isinstance(index, slice):
            _CountingList.copied += len(out)
        return out


def test_statements_are_split_in_one_pass():
    from mlx_cache_server.serving.lark_regex import _statements, _tokens

    text = "".join(f'r{i}: "x"\n\n\n' for i in range(900))
    tokens = _CountingList(_tokens(text))
    _CountingList.copied = 0
    assert len(_statements(tokens)) == 900
    assert _CountingList.copied <= len(tokens)


def test_a_grammar_past_the_size_bound_is_refused_before_it_is_read(monkeypatch):
    from mlx_cache_server.serving import lark_regex

    def unread(text):
        raise AssertionError("tokenized")

    monkeypatch.setattr(lark_regex, "_tokens", unread)
    with pytest.raises(NotRegular, match="characters"):
        lark_to_regex('start: "a"\n' + "// padding\n" * 10_000)


def test_one_rule_used_many_times_is_refused_before_it_is_written_out():
    # A rule of nearly MAX_CHARS used thousands of times in one rule: refused on the way,
    # not after building a string thousands of times the bound.
    grammar = "start: a\na: " + " ".join(["b"] * 5_000) + f'\nb: "{"x" * 40_000}"\n'
    with pytest.raises(NotRegular, match="over"):
        lark_to_regex(grammar)


def test_a_counted_repetition_past_the_bound_leaves_the_tool_free():
    # llguidance takes "a"~1000000 and fails at the reply's second token.
    for syntax, definition in (("lark", 'start: "a"~1000000'), ("regex", "(a{1000}){1000}")):
        spec = {"type": "grammar", "syntax": syntax, "definition": definition}
        tool = {"type": "custom", "name": "t", "format": spec}
        schema = _custom_parameters(tool, "t", "tools[0]")
        assert schema["properties"]["input"] == {"type": "string"}, syntax
