"""A message's content: text, or where it holds images, chat completions' list of parts.

Each surface translates its messages into chat's, and most of what it joins or wraps is
text; an image part among them keeps its place, so these join and wrap either form and
give plain text back wherever no image is involved (a text-only request renders exactly
as before).
"""

from __future__ import annotations

from typing import Any

Content = str | list[dict[str, Any]]

Piece = str | dict[str, Any]  # a piece of a message: text, or chat's image part


def image_part(url: str) -> dict[str, Any]:
    """Chat completions' part for an image's data URL."""
    return {"type": "image_url", "image_url": {"url": url}}


def joined(pieces: list[Piece], sep: str) -> Content:
    """A message's content from its pieces: text joined by `sep`, or where an image is
    among them, chat's parts (the texts between images joined by `sep`)."""
    parts: list[dict[str, Any]] = []
    texts: list[str] = []
    for piece in pieces:
        if isinstance(piece, str):
            texts.append(piece)
            continue
        if texts:
            parts.append({"type": "text", "text": sep.join(texts)})
            texts = []
        parts.append(piece)
    if not parts:
        return sep.join(texts)
    if texts:
        parts.append({"type": "text", "text": sep.join(texts)})
    return parts


def appended(content: Content, more: Content, sep: str) -> Content:
    """Two turns' contents as one (a client's consecutive turns of one role), `sep` between."""
    return concat(content, sep, more)


def concat(*contents: Content) -> Content:
    """`contents` one after the other: text where all are text, else parts."""
    if all(isinstance(c, str) for c in contents):
        return "".join(contents)  # type: ignore[arg-type]
    parts: list[dict[str, Any]] = []
    for c in contents:
        for part in [{"type": "text", "text": c}] if isinstance(c, str) else c:
            if part.get("type") == "text" and parts and parts[-1].get("type") == "text":
                parts[-1] = {"type": "text", "text": parts[-1]["text"] + part["text"]}
            elif part.get("type") != "text" or part["text"]:
                parts.append(part)
    return parts
