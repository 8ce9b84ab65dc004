"""The APIs the server speaks (server/ routes to them): OpenAI's chat completions and
completions (openai.py), Anthropic's Messages (anthropic.py), OpenAI's Responses
(responses.py) and llama.cpp's fill-in-the-middle (infill.py).

Each turns its request into the one request the engine serves (``Request``: the prompt's
tokens through the model's chat template, its tools and reply reader, the reply's
``ReplyOptions``), so that one conversation sent through any of them is the same prompt,
and the same reply; and it writes the reply, whole (``Protocol.reply``) or streamed
(``Protocol.events``), and its errors (``Protocol.error``), in its own shapes. A check that
fails raises a ``RequestError``, or a ``UserError`` naming its field (the server answers
both in the protocol's error shape, with the field as ``param``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

if TYPE_CHECKING:
    from ..generation import GenerationResponse
    from ..options import ReplyOptions
    from ..replies import ChatResponse, ReplySplitter, ToolCall

# A stream silent this long while generating (its text held while it may be a tool call) sends
# an event its clients count as activity: Codex's and Claude Code's idle limits count neither
# SSE comments nor Anthropic's pings.
ALIVE_SECONDS = 5.0


class RequestError(Exception):
    """A request the server will not serve: HTTP status, message and the offending field."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


@dataclass
class Request:
    """One request, parsed: what the engine is asked (``ids``, ``options``), how its reply is
    read (``chat``: through ``splitter``) and written (``stream``, by ``protocol``)."""

    ids: List[int]
    chat: bool
    stream: bool
    options: "ReplyOptions"
    protocol: "Protocol"
    model: str = ""  # the model id asked for: earlier replies are drafted from per id, never across ids
    splitter: Optional["ReplySplitter"] = None  # a chat reply's reader: answer text, reasoning, tool calls
    echo: Dict[str, Any] = field(default_factory=dict)  # what the protocol's reply needs of the request


@dataclass
class Collected:
    """A whole reply, gathered from its pieces."""

    text: str = ""
    reasoning: str = ""
    calls: List["ToolCall"] = field(default_factory=list)
    last: Optional["GenerationResponse"] = None
    reasoning_tokens: int = 0  # tokens whose text went to the reasoning
    logprobs: List[Dict[str, Any]] = field(default_factory=list)  # per token, where the protocol reports them

    def add(self, piece: "GenerationResponse") -> None:
        self.text += piece.text
        self.reasoning += getattr(piece, "reasoning", "")
        self.reasoning_tokens += bool(getattr(piece, "reasoning", ""))
        self.calls += getattr(piece, "tool_calls", [])
        self.last = piece


class Protocol:
    """One API's shapes: its requests, its replies, whole and streamed, and its errors."""

    def parse(self, body: Any, engine, default_max_tokens: int) -> Request:
        """The request the engine serves, checked: the first problem is a RequestError."""
        raise NotImplementedError

    def error(self, error: RequestError) -> Dict[str, Any]:
        raise NotImplementedError

    def collect(self, request: Request, collected: Collected, piece: "GenerationResponse") -> None:
        """Gather one piece of a whole (not streamed) reply."""
        collected.add(piece)

    def reply(self, request: Request, collected: Collected, usage: Dict[str, Any]) -> Dict[str, Any]:
        """The whole reply's body; ``usage``: OpenAI's counts and the speculation (server.usage)."""
        raise NotImplementedError

    def events(self, request: Request, responses: Iterator["ChatResponse"],
               usage: Callable[[Optional["GenerationResponse"]], Dict[str, Any]]) -> Iterator[bytes]:
        """The streamed reply's server-sent events, ending with the protocol's last (a reply
        cut off ends without it: ``cut_off`` raised in the stream by the server)."""
        raise NotImplementedError

    def stream_error(self, error: RequestError) -> bytes:
        """The event that ends a stream cut off by ``error``."""
        raise NotImplementedError

    def keepalive(self, request: "Request", to_read: Optional[int] = None) -> bytes:
        """What ``request``'s stream says while it waits or its prompt is read (``to_read``:
        the prompt tokens its reading reads, the rest being in the cache; None: waiting)."""
        return b": waiting\n\n"


def usage(last: Optional["GenerationResponse"], prompt_tokens: int,
          first_token_seconds: Optional[float] = None) -> Dict[str, Any]:
    """OpenAI's counts, and ours: the speculation, and the seconds from the request's arrival
    to its first token (waiting for a seat and reading the prompt included)."""
    completion = last.generation_tokens if last is not None else 0
    return {
        "time_to_first_token": round(first_token_seconds, 3) if first_token_seconds is not None else None,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": last.prompt_reused if last is not None else 0},
        "speculation": {
            "tokens_per_forward": last.tokens_per_forward if last is not None else 0.0,
            "target_forwards": last.target_forwards if last is not None else 0,
            "tokens_per_second": last.generation_tps if last is not None else 0.0,
            "drafters": {name: {"proposed": stats.proposed, "accepted": stats.accepted}
                         for name, stats in (last.sources if last is not None else {}).items()},
            "rechecked": last.rechecked if last is not None else 0,
            "batch_rows": round(last.batch_rows, 2) if last is not None else 1.0,
            "nodes_per_round": round(last.nodes_per_round, 2) if last is not None else 0.0,
            "drafting": last.drafting if last is not None else "",
            "drafting_off": last.drafting_off if last is not None else [],
        },
    }


def sse(event: Optional[str], data: Dict[str, Any]) -> bytes:
    """One server-sent event (named, or a bare data line)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def number(body: Dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    """A number field from ``low`` to ``high`` (``default`` when absent)."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise RequestError(400, f"{name} must be a number from {low:g} to {high:g}", name)
    return float(value)


def whole(body: Dict[str, Any], name: str, low: int, high: int, default: Optional[int] = None,
          required: bool = False) -> Optional[int]:
    """A whole-number field from ``low`` to ``high``."""
    value = body.get(name)
    if value is None:
        if required:
            raise RequestError(400, f"{name} is required: a whole number from {low} to {high}", name)
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise RequestError(400, f"{name} must be a whole number from {low} to {high}", name)
    return value


def flag(body: Dict[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(400, f"{name} must be true or false", name)
    return value


def texts(body: Dict[str, Any], name: str, most: int) -> Optional[List[str]]:
    """A list of up to ``most`` strings (a single string: a list of one)."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or len(value) > most or not all(isinstance(s, str) for s in value):
        raise RequestError(400, f"{name} must be a string or a list of up to {most} strings", name)
    return value


def with_silences(pieces: Iterable["ChatResponse"]) -> Iterator[Tuple["ChatResponse", bool]]:
    """Each piece of a streamed reply, and whether the stream will have said nothing for
    ``ALIVE_SECONDS`` before it (a piece with no text of its own: text held while it may
    be a call), when the protocol sends an event its clients count as activity."""
    said = time.monotonic()
    for piece in pieces:
        now = time.monotonic()
        silent = not (piece.reasoning or piece.text or piece.tool_calls) and now - said > ALIVE_SECONDS
        if silent or piece.reasoning or piece.text or piece.tool_calls:
            said = now
        yield piece, silent
