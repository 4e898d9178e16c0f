"""Argument types and input files shared by the bench scripts: bad values are refused by argparse (or
with a ``SystemExit`` naming the file) before any measurement starts, not deep inside a run."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def command_line(module: str, argv: list[str] | None) -> str:
    """The shell command that runs ``module`` with ``argv`` (the process's own arguments when None), for
    a report's "made by" line: a call from Python records the arguments it passed."""
    return shlex.join(["python3", "-m", module, *(sys.argv[1:] if argv is None else argv)])


def git_commit() -> str:
    """The checked-out commit of this tree (``+dirty`` when it has changes), or "unknown" outside git."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "") if head else "unknown"


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value
    return parse


positive_int = at_least(1)


def int_list(minimum: int = 1) -> Callable[[str], list[int]]:
    """An argparse type: comma-separated integers, each >= ``minimum``, at least one."""
    one = at_least(minimum)

    def parse(text: str) -> list[int]:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"expected comma-separated integers >= {minimum}, got {text!r}")
        return [one(v.strip()) for v in text.split(",")]
    return parse


def positive_seconds(text: str) -> float:
    """An argparse type: a number of seconds > 0 (``inf``: no limit)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}") from None
    if math.isnan(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return value


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string"}


def read_json(path: Path, what: str, keys: dict[str, type] | None = None) -> dict[str, Any]:
    """A JSON object file holding ``keys`` (name: the type its value must have); anything else is a
    ``SystemExit`` naming the file."""
    keys = keys or {}
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SystemExit(f"{what} {path}: not a readable JSON file ({e})") from None
    if not isinstance(doc, dict) or any(not isinstance(doc.get(k), t) for k, t in keys.items()):
        want = ", ".join(f"{k!r} ({_JSON_TYPES.get(t, t.__name__)})" for k, t in keys.items())
        raise SystemExit(f"{what} {path}: expected a JSON object" + (f" with {want}" if want else ""))
    return doc


def read_gsm8k(path: Path, answers: bool = True) -> list[dict[str, str]]:
    """The problems of a GSM8K-style JSONL (objects with a string ``question`` and, where ``answers``, a
    string ``answer``); a missing or empty file or a malformed line is a ``SystemExit`` naming it."""
    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"{path}: no such GSM8K file")
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SystemExit(f"{path}:{i}: not JSON ({e})") from None
        need = ("question", "answer") if answers else ("question",)
        if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in need):
            raise SystemExit(f"{path}:{i}: expected an object with string {' and '.join(map(repr, need))}")
        rows.append(row)
    if not rows:
        raise SystemExit(f"{path}: holds no problems")
    return rows
