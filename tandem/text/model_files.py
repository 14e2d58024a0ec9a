"""Reading the JSON files of a Hugging Face model directory, with errors that name them.

A model that cannot be loaded must fail at start with one message naming the file and
the key, never with a ``KeyError`` or a ``JSONDecodeError`` traceback; every reader of a
model directory on the scheduler side goes through here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tandem.errors import InvalidInput

# Reason carried by every "this model directory is unusable" error.
BAD_MODEL = "BAD_MODEL"


def read_json(path: Path, *, required: bool) -> dict[str, Any] | None:
    """The JSON object in ``path``; ``None`` when it is absent and not ``required``."""
    if not path.is_file():
        if required:
            raise InvalidInput(f"{path}: file missing", BAD_MODEL)
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"{path}: not UTF-8 text ({exc.reason})", BAD_MODEL) from exc
    except json.JSONDecodeError as exc:
        raise InvalidInput(
            f"{path}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})",
            BAD_MODEL,
        ) from exc
    except OSError as exc:
        raise InvalidInput(f"{path}: unreadable ({exc.strerror})", BAD_MODEL) from exc
    if not isinstance(data, dict):
        raise InvalidInput(f"{path}: expected a JSON object, got {type(data).__name__}", BAD_MODEL)
    return data


def bad_key(path: Path, key: str, problem: str) -> InvalidInput:
    """The error for one key of one file: ``<file>: <key> <problem>``."""
    return InvalidInput(f"{path}: {key} {problem}", BAD_MODEL)
