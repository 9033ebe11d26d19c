"""JSONL files read line by line, every bad line named: no torch, so `areal check` reads data with it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from arealcli.errors import DataError


def read_jsonl(path: Path) -> tuple[list[tuple[int, Any]], list[str]]:
    """(line number, parsed value) of every non-blank line, and `file:line:col: problem` of every bad one.

    UTF-8 only (a BOM is allowed); each line one JSON value.
    """
    if path.is_dir():
        raise DataError(f"{path} is a directory; give the JSONL file inside it")
    try:
        raw_lines = path.read_bytes().splitlines()
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None
    rows, bad = [], []
    for lineno, raw in enumerate(raw_lines, 1):
        if lineno == 1:
            raw = raw.removeprefix(b"\xef\xbb\xbf")
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            bad.append(
                f"{path}:{lineno}:{e.start + 1}: not valid UTF-8 (byte 0x{raw[e.start]:02x}); save the file as UTF-8"
            )
            continue
        if not line.strip():
            continue
        try:
            rows.append((lineno, json.loads(line)))
        except json.JSONDecodeError as e:
            bad.append(f"{path}:{lineno}:{e.colno}: not valid JSON: {e.msg}")
        except RecursionError:
            bad.append(f"{path}:{lineno}: JSON nested too deeply")
    return rows, bad
