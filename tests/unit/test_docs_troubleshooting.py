"""docs/troubleshooting.md quotes the errors as ckpt-engine prints them: every message it lists (its
`###` headings) is still one the code raises or logs, piece for piece between the parts that vary,
and docs/faq.md's links lead somewhere."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "troubleshooting.md"
# Split a message where the code varies or composes it: <placeholders> (quoted by !r or not), numbers,
# and the punctuation between the parts of a composed message (": ", "; ", "(...)", ", ").
VARYING = re.compile(r"'?<[^>]*>'?|\d+|: |; |, |[()\[\]]")
PREFIX = re.compile(r"^(?:ckpt-engine \w+: )?[A-Z]\w+: ")   # the class name the message is printed after
MIN_PIECE = 12


def _code_text() -> str:
    """Every string of the packages, implicit concatenations joined ("...a "\\n  f"b..." -> "...a b...")."""
    text = "\n".join(p.read_text() for p in ROOT.glob("ckpt_*/**/*.py"))
    return re.sub(r"([\"'])\s*\n\s*[rbfRBF]{0,2}\1", "", text)


def _in(piece: str, code: str) -> bool:
    """``piece`` is in the code, or it is after its first word: a composed message joins its parts
    with a word (``f"... route ({routes}) of {rule}"``: the doc's "of a loopback engine")."""
    rest = piece.split(" ", 1)[-1]
    return piece in code or (len(rest) >= MIN_PIECE and rest in code)


def _messages() -> list[str]:
    return [m.group(1) for m in re.finditer(r"^### `(.+?)`(?: \(a WARNING\))?$", DOC.read_text(), re.M)]


def test_every_listed_message_is_one_the_code_prints():
    code = re.sub(r"\{[^{}]*\}|%\w", "\x00", _code_text())   # the code's own varying parts
    messages = _messages()
    assert len(messages) >= 30, f"docs/troubleshooting.md lists {len(messages)} messages"
    stale = []
    for message in messages:
        pieces = [p.strip(" ") for p in VARYING.split(PREFIX.sub("", message))]
        long = [p for p in pieces if len(p) >= MIN_PIECE]
        assert long, f"{message!r}: nothing long enough to look for"
        stale += [(message, p) for p in long if not _in(p, code)]
    assert not stale, "messages no longer in the code (update docs/troubleshooting.md):\n" + \
        "\n".join(f"  {p!r}  of  {m!r}" for m, p in stale)


def test_each_entry_says_the_cause_or_the_fix():
    sections = re.split(r"^### ", DOC.read_text(), flags=re.M)[1:]
    for section in sections:
        assert "Cause" in section or "Fix" in section, section[:200]
