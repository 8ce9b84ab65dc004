"""Errors a user can fix, and the checks on the text users hand us, written once (what a
model's directory says of itself is checked in configs.py)."""

from __future__ import annotations

import difflib
from typing import Optional


class UserError(ValueError):
    """A problem the user can fix. Commands print it as one line and exit 1; the server
    answers it with a 400 whose ``param`` is ``field``, the request field at fault (None:
    the request as a whole). ``shared``: every rank of a sharded model found it alike (only
    rank 0 says it)."""

    def __init__(self, message: str, field: Optional[str] = None, shared: bool = False):
        super().__init__(message)
        self.field, self.shared = field, shared


def did_you_mean(given: str, words) -> str:
    """" (did you mean 'X'?)" for a typo of one of ``words`` (a letter more, less, different
    or two swapped), else ""."""

    close = [w for w in words if difflib.SequenceMatcher(None, given.lower(), w).ratio() >= 0.7]
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_text(text: str, what: str) -> str:
    """``text`` if it can be encoded (no lone surrogates, which undecodable input and
    some JSON escapes produce), else one line naming ``what`` (its field)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UserError(f"{what} is not valid Unicode text (a lone surrogate at character {exc.start}); "
                        "send UTF-8 text", what) from None
    return text


# JSON nesting a request's tools and tool calls may reach: far past any real schema, and far
# short of what renders a chat template or a grammar into a RecursionError.
MAX_NESTING = 32


def check_nesting(value, what: str, limit: int = MAX_NESTING):
    """``value`` (JSON data) if its lists and objects nest at most ``limit`` deep, else one
    line naming ``what``. Walked without recursion, so any depth is measured."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                raise UserError(f"{what} nests lists and objects more than {limit} deep; flatten it", what)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return value


MAX_SEED = (1 << 63) - 1  # a seed is a signed 64-bit whole number, as OpenAI's is


# Replies in progress at once, by default (their rounds share forward passes): 16 SmolLM2 chat
# clients made 1.17 times the tokens of 8 seats and a queue, their first token after 1.3 s
# against 11 s (docs/benchmarks.md, "Prompts beside few replies"); mlx-lm's server decodes
# up to 32 at once.
MAX_CONCURRENCY = 16
MAX_QUEUE = 64  # requests waiting for a seat, by default; past that one is refused with Busy
PROMPT_DISK_BYTES = 8 << 30  # the server's long prompts kept on disk, by default (prompt_store.py)


class Busy(RuntimeError):
    """Every seat is taken and the queue is full: try again in ``retry_after`` seconds (the
    server answers it with a 429 and a Retry-After header)."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after
