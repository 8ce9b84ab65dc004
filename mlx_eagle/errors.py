"""Errors a user can fix, and the checks on what users hand us, written once."""

from __future__ import annotations

import json
from pathlib import Path


class UserError(ValueError):
    """A problem the user can fix. Commands print it as one line and exit 1; the server
    answers it with a 400."""


def read_config(directory: Path, what: str) -> dict:
    """``directory``/config.json as a JSON object, or one line: no such file (it is not
    ``what``), not JSON, or not an object."""
    file = Path(directory) / "config.json"
    if not Path(directory).is_dir():
        raise UserError(f"{directory} is not a directory; pass {what}")
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise UserError(f"{directory} has no config.json; is it {what}?") from None
    except (OSError, ValueError, RecursionError) as exc:
        raise UserError(f"{file} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise UserError(f"{file} holds a JSON {type(config).__name__}, not an object")
    return config


def check_text(text: str, what: str) -> str:
    """``text`` if it can be encoded (no lone surrogates, which undecodable input and
    some JSON escapes produce), else one line naming ``what``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UserError(f"{what} is not valid Unicode text (a lone surrogate at character {exc.start}); "
                        "send UTF-8 text") from None
    return text
