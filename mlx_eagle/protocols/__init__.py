"""The APIs the server speaks beside OpenAI's chat completions and completions (server.py):
Anthropic's Messages (anthropic.py) and OpenAI's Responses (responses.py).

Each turns its request into the one request the engine serves (``Request``: the prompt's
tokens through the model's chat template, its tools and reply reader, the options of
``Engine.generate``), so that one conversation sent through any of them is the same prompt,
and the same reply; and it writes the reply, whole (``Protocol.reply``) or streamed
(``Protocol.events``), and its errors (``Protocol.error``), in its own shapes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional

if TYPE_CHECKING:
    from ..generation import GenerationResponse
    from ..replies import ChatResponse, ReplySplitter, ToolCall


class RequestError(Exception):
    """A request the server will not serve: HTTP status, message and the offending field."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


@dataclass
class Request:
    ids: List[int]
    chat: bool
    stream: bool
    include_usage: bool = False
    options: Dict[str, Any] = field(default_factory=dict)
    model: str = ""  # the model id asked for: earlier replies are drafted from per id, never across ids
    splitter: Optional["ReplySplitter"] = None  # a chat reply's reader: answer text, reasoning, tool calls
    top_logprobs: Optional[int] = None  # log-probabilities asked for: the chosen token's and this many more
    protocol: Optional["Protocol"] = None  # who writes the reply (None: OpenAI's chat completions and completions)
    echo: Dict[str, Any] = field(default_factory=dict)  # request fields the protocol's reply repeats


@dataclass
class Collected:
    """A whole reply, gathered from its pieces."""

    text: str = ""
    reasoning: str = ""
    calls: List["ToolCall"] = field(default_factory=list)
    last: Optional["GenerationResponse"] = None
    reasoning_tokens: int = 0  # tokens whose text went to the reasoning

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

