"""Text that fits a width: times as `m:ss`, names and paths shortened in the middle, values wrapped at
spaces (never inside a word)."""

from __future__ import annotations

import re


def clock(seconds: float) -> str:
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def shorten(text: str, width: int) -> str:
    """`text` in at most `width` characters: its start and its end kept, `…` between (a path keeps
    its file name, an experiment name its distinguishing suffix)."""
    if len(text) <= width:
        return text
    if width <= 1:
        return "…"[:width]
    tail = (width - 1) // 2
    return text[: width - 1 - tail] + "…" + (text[-tail:] if tail else "")


def fit_lines(text: str, width: int) -> list[str]:
    """`text` cut into lines of at most `width` characters at spaces; a word longer than a line (a
    path) is shortened in the middle rather than split."""
    lines: list[str] = []
    current = ""
    for token in re.findall(r"\s*\S+", text):  # each word with the spaces before it
        word = token.lstrip()
        if len(word) > width:
            word, token = shorten(word, width), token[: len(token) - len(word)] + shorten(word, width)
        if not current:
            current = word
        elif len(current) + len(token) <= width:
            current += token
        else:
            lines.append(current)
            current = word
    return [*lines, current]
