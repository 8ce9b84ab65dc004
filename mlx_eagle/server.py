"""An OpenAI-compatible HTTP server on this machine, EAGLE-accelerated.

    python -m mlx_eagle.server [--model M] [--draft D] [--port 8080]

Serves /v1/chat/completions and /v1/completions (streamed or not; a completion with a
``suffix`` fills in the middle, infill.py), /v1/models (and /v1/models/{id}), /metrics and
/health on 127.0.0.1 by default; and, through protocols/, Anthropic's /v1/messages (and
count_tokens), OpenAI's /v1/responses (and GET, DELETE /v1/responses/{id}) and llama.cpp's
/infill. Thinking budgets (``thinking_budget``, ``reasoning_effort``) hold inside speculation
(thinking.py). One model and head are
loaded once; up to --max-concurrency requests are served at once, their rounds verified
together in one forward pass (scheduler.py), and up to --max-queue more wait for a seat
(a streamed one hears an SSE comment every few seconds); past that a request gets a 429
with Retry-After. A client that disconnects cancels its generation. Speculation
statistics come in each response's ``usage.speculation``.

What it promises a local machine: requests whose Host header is not this machine's
name (or one given with --allow-host) get 403, so a web page cannot drive it through
DNS rebinding; POST bodies must be application/json (415 otherwise; a page cannot send
that cross-origin without the browser asking first) of at most 1 MiB (413); a client
silent for 60 s is dropped (a body that stops arriving gets 408); SIGTERM or Ctrl-C
stops taking requests and cuts replies in flight, which end in a 503 error (or, streamed,
an error event and no [DONE]), never in a reply that looks finished.

A client that closes its sending side after the request (``nc -N``, shutdown(SHUT_WR))
still gets its whole reply: a closed read side is not taken for a departed client. A
client that has gone is found by the next write: a streamed reply writes every round (and
an SSE comment after each 512-token chunk of a long prompt); a plain reply to a client
whose read side has closed starts at once and writes a space (JSON allows leading white
space) every round and after each chunk of a long prompt, so a departed client cancels its
generation within two rounds (or chunks) either way. Fields the server does not implement
(penalties, logit_bias) get a 400 naming the field, unless they ask for what it does anyway.
``response_format`` (``json_object``, ``json_schema``) holds the reply to the grammar it
asks for (grammar.py), drafting still on; a schema the grammar engine cannot follow gets a
400 naming what is wrong. ``logprobs`` (and ``top_logprobs`` up to 20) are the target's own,
from the pass that chose each token.

Chat replies come back split (replies.py): the model's thinking as ``reasoning_content``,
its tool calls as ``tool_calls`` (``finish_reason: "tool_calls"``), streamed as deltas the
way OpenAI streams them (each call whole, in one delta).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import select
import signal
import socket
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .cli import LAUNCHED, add_history_arguments, add_kv_arguments, add_model_arguments, history_choice, kv_options, \
    new_parser, run_cli
from .errors import MAX_CONCURRENCY, MAX_QUEUE, MAX_SEED, Busy, UserError, check_options, check_text
from .grammar import response_grammar
from .infill import infill_prompt
from .metrics import CONTENT_TYPE, Metrics, log_line
from .protocols import Collected, Protocol, Request, RequestError, number
from .protocols.infill import Infill
from .protocols.store import STORE_BYTES, ResponseStore, not_found
from .thinking import check_budget, check_budget_alone, effort_budget
from .trees import parse_tree

if TYPE_CHECKING:  # they load mlx-lm: imported where used, so that --help answers at once
    from .generation import GenerationResponse
    from .session import Engine

MAX_BODY_BYTES = 1 << 20
IDLE_SECONDS = 60  # a client silent this long (reading or writing) is dropped
STALL_SECONDS = 120  # a generation this long without progress makes /health answer 503 "stalled"
STOP_SECONDS = 10  # SIGTERM or Ctrl-C ends the process within this, whatever is stuck
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
# Each POST route and what it speaks: OpenAI's chat completions and completions (here),
# Anthropic's Messages, OpenAI's Responses, llama.cpp's infill (protocols/).
POST_ROUTES = {"/v1/chat/completions": "chat", "/chat/completions": "chat", "/v1/completions": "completions",
               "/completions": "completions", "/v1/messages": "messages", "/v1/messages/count_tokens": "count_tokens",
               "/v1/responses": "responses", "/responses": "responses", "/infill": "infill"}
GET_ROUTES = ("/health", "/v1/models", "/models", "/metrics")
RESPONSE_ROUTE = re.compile(r"/v1/responses/(?P<id>[^/]+)")  # GET and DELETE a stored response
CONTENT_LENGTH = re.compile(r"[0-9]{1,15}")  # ASCII digits only ("\xb2".isdigit() is True), and bounded
# A Host header: a name or an address (an IPv6 one in brackets), then at most a port; nothing else
# ("localhost:80@evil.com" names no host of ours).
HOST_HEADER = re.compile(r"(?P<name>\[[0-9a-f:.%]+\]|[a-z0-9._-]+)(?::[0-9]{1,5})?")
# OpenAI fields this server does not implement, and the values that ask for nothing it lacks:
# such a field with another value is refused (400 naming it), as other servers do, rather
# than silently ignored.
UNSUPPORTED = {
    "functions": lambda v: v in (None, []),  # the older names of tools and tool_choice: send those
    "function_call": lambda v: v in (None, "none", "auto"),
    "frequency_penalty": lambda v: v in (None, 0),
    "presence_penalty": lambda v: v in (None, 0),
    "logit_bias": lambda v: v in (None, {}),
    "best_of": lambda v: v in (None, 1),
    "echo": lambda v: v in (None, False),
}


def _prompt(body: dict, tokenizer) -> Tuple[List[int], Tuple[int, ...]]:
    """A completion's prompt: its text or token ids; with a ``suffix``, the model's
    fill-in-the-middle prompt for what goes between the two (infill.py), and the tokens
    that end the middle."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise RequestError(400, "suffix must be a string: the text after the insertion point", "suffix")
    if suffix:
        if not isinstance(prompt, str):
            raise RequestError(400, "with a suffix, prompt must be a string: the text before the insertion point",
                               "prompt")
        try:
            infill = infill_prompt(tokenizer, check_text(prompt, "prompt"), check_text(suffix, "suffix"))
        except UserError as error:
            raise RequestError(400, str(error), "suffix") from None
        return infill.ids, infill.stop_tokens
    if isinstance(prompt, str) and prompt:
        try:
            return tokenizer.encode(check_text(prompt, "prompt")), ()
        except UserError as error:
            raise RequestError(400, str(error), "prompt") from None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt), ()
    raise RequestError(400, "prompt must be a non-empty string (or one list of token ids)", "prompt")


def parse_request(body: Any, chat: bool, engine: Engine, default_max_tokens: int) -> Request:
    """Check a request body field by field; the first problem becomes a RequestError."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    for name, asks_nothing in UNSUPPORTED.items():
        if name in body and not _is_harmless(asks_nothing, body[name]):
            raise RequestError(400, f"{name} is not supported by this server; leave it out", name, "unsupported_field")
    limit = engine.context_length or 1 << 30
    from .protocols.chat import chat_ids

    splitter, ends = None, ()
    if chat:
        ids, splitter = chat_ids(engine, body.get("messages"), body.get("tools"), body.get("tool_choice"))
    else:
        ids, ends = _prompt(body, engine.tokenizer)
    vocab = engine.model.args.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise RequestError(400, f"prompt token ids must lie in 0..{vocab - 1}", "prompt")
    if len(ids) >= limit:
        raise RequestError(400, f"the prompt is {len(ids)} tokens; the model's context holds {limit}",
                           "messages" if chat else "prompt", "context_length_exceeded")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(name, default_max_tokens)
    if max_tokens is None:
        max_tokens = default_max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= limit:
        raise RequestError(400, f"{name} must be an integer from 1 to the context length, {limit}", name)
    n = body.get("n", 1)
    if n not in (None, 1):
        raise RequestError(400, "only n=1 is supported", "n")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) for s in stop)):
        raise RequestError(400, "stop must be a string or a list of up to 4 strings", "stop")
    try:
        stop = [check_text(text, "stop") for text in stop] if stop is not None else None
    except UserError as error:
        raise RequestError(400, str(error), "stop") from None
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED):
        raise RequestError(400, f"seed must be an integer from 0 to {MAX_SEED}", "seed")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, "stream must be true or false", "stream")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise RequestError(400, "stream_options must be an object", "stream_options")
    top_logprobs = _logprobs(body, chat)
    try:
        response_grammar(body.get("response_format"))
    except UserError as error:
        raise RequestError(400, str(error), "response_format") from None
    # (A reply made to begin with a tool call is that call: response_format is for answer text.)
    response_format = None if splitter is not None and splitter.forced_call else body.get("response_format")
    options = dict(max_tokens=max_tokens, temp=number(body, "temperature", 0.0, 0.0, 2.0),
                   top_p=number(body, "top_p", 1.0, 0.0, 1.0), seed=seed, stop=stop,
                   logprobs=top_logprobs is not None, response_format=response_format,
                   thinking_budget=_thinking_budget(body), stop_tokens=ends or None)
    if options["top_p"] == 0.0:
        raise RequestError(400, "top_p must be above 0", "top_p")
    model = body.get("model")
    return Request(ids=ids, chat=chat, stream=stream, include_usage=bool(stream_options.get("include_usage")),
                   options=options, model=model if isinstance(model, str) else "", splitter=splitter,
                   top_logprobs=top_logprobs)


def _thinking_budget(body: dict) -> Optional[int]:
    """A chat completion's thinking budget: ``thinking_budget`` (tokens), else the one
    ``reasoning_effort`` names (thinking.EFFORT_BUDGETS)."""
    name = "thinking_budget" if body.get("thinking_budget") is not None else "reasoning_effort"
    try:
        return check_budget(body[name]) if name == "thinking_budget" else effort_budget(body.get(name), name)
    except UserError as error:
        raise RequestError(400, str(error), name) from None


MAX_TOP_LOGPROBS = 20


def _logprobs(body: dict, chat: bool) -> Optional[int]:
    """How many alternatives to report beside each chosen token's log-probability (None: no
    log-probabilities). Chat: ``logprobs`` true, ``top_logprobs`` 0-20; completions: ``logprobs`` 0-5."""
    value = body.get("logprobs")
    if chat:
        if value is not None and not isinstance(value, bool):
            raise RequestError(400, "logprobs must be true or false", "logprobs")
        top = body.get("top_logprobs")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int)
                                or not 0 <= top <= MAX_TOP_LOGPROBS):
            raise RequestError(400, f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}", "top_logprobs")
        if top and not value:
            raise RequestError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (top or 0) if value else None
    if value is None or value is False:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 5:
        raise RequestError(400, "logprobs must be an integer from 0 to 5", "logprobs")
    return value


def token_logprobs(tokenizer, response: GenerationResponse, top: int) -> Dict[str, Any]:
    """One token's entry in OpenAI's ``logprobs.content``: its text, bytes and log-probability,
    and the ``top`` most likely tokens at its position."""
    def entry(token: int, logprob: float) -> Dict[str, Any]:
        text = tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    values = np.array(response.logprobs)  # evaluated on the engine's thread; read here on the host
    result = entry(response.token, float(values[response.token]))
    best = np.argpartition(-values, top - 1)[:top] if top else []
    result["top_logprobs"] = [entry(int(token), float(values[token]))  # (none a grammar refused: -inf)
                              for token in sorted(best, key=lambda token: -values[token]) if values[token] > -np.inf]
    return result


def completion_logprobs(entries: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The legacy completions shape of the same entries."""
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def _is_harmless(asks_nothing, value: Any) -> bool:
    try:
        return bool(asks_nothing(value))
    except TypeError:  # an unhashable value where a scalar was expected
        return False


def usage(last: Optional[GenerationResponse], prompt_tokens: int,
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


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "Server"
    read_closed = False  # the client has shut its sending side (it may still be reading)
    arrived = 0.0  # when the request in progress was queued (time.monotonic)
    first_token_seconds: Optional[float] = None  # from then to its first token
    heartbeat = False  # a plain reply's status line is out, spaces follow until its JSON
    last: Optional[GenerationResponse] = None  # the request's last response so far
    token_at = 0.0  # when it came (time.monotonic)
    gaps: List[float] = []  # the seconds between its responses
    status = 200  # the status the request in progress was answered with
    request_id = ""  # its id in the --log-requests line
    reply_text = ""  # its reply's text so far (kept for --log-text)

    def setup(self) -> None:
        self.timeout = self.server.idle_seconds
        super().setup()

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base class's name)
        if not self.server.quiet:
            sys.stderr.write(f"{self.address_string()} {format % args}\n")

    def handle_one_request(self) -> None:
        try:
            super().handle_one_request()
        except (ConnectionError, TimeoutError):  # the client left or went silent: nothing to tell it
            self.close_connection = True

    def send_error(self, code: int, message: Optional[str] = None, explain: Optional[str] = None) -> None:
        """http.server's own refusals (a garbage request line, 431 headers too large, 414, 505)
        in this server's JSON, not its HTML page."""
        self.close_connection = True
        # A request line it could not parse leaves http.server at HTTP/0.9, which has no
        # status line; nobody speaks 0.9 any more, and the status is the answer.
        self.request_version = "HTTP/1.0" if self.request_version == "HTTP/0.9" else self.request_version
        phrase = HTTPStatus(code).phrase if code in HTTPStatus._value2member_map_ else "error"
        self._send_error(RequestError(code, message or phrase), [("Connection", "close")])

    def _send_json(self, status: int, payload: Dict[str, Any], headers: Sequence[tuple] = ()) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _send_error(self, error: RequestError, headers: Sequence[tuple] = ()) -> None:
        """``error`` in the shape of the protocol the route speaks."""
        self.status = error.status
        protocol = self.server.protocols.get(POST_ROUTES.get(self.route, ""))
        if protocol is not None:
            self._send_json(error.status, protocol.error(error), headers)
            return
        kind = "server_error" if error.status >= 500 else "invalid_request_error"
        self._send_json(error.status, {"error": {"message": error.message, "type": kind,
                                                 "param": error.param, "code": error.code}}, headers)

    @property
    def route(self) -> str:
        return getattr(self, "path", "").split("?", 1)[0]  # (no path: a request line http.server could not read)

    def _check_host(self) -> None:
        """403 unless the Host header names this machine (or an allowed name)."""
        host = (self.headers.get("Host") or "").strip().lower()
        parsed = HOST_HEADER.fullmatch(host)
        name = parsed.group("name").strip("[]") if parsed else host
        if parsed is None or name not in self.server.allowed_hosts:
            raise RequestError(403, f"host {name or '(none)'!r} is not allowed; start the server with "
                                    f"--allow-host {name or 'NAME'} to serve it")

    def _not_allowed(self) -> None:
        """405 for a method a known route does not take, 404 for an unknown route."""
        allowed = "POST" if self.route in POST_ROUTES else "GET, DELETE" if RESPONSE_ROUTE.fullmatch(self.route) \
            else "GET" if self._is_get_route() else None
        if allowed is None:
            self._send_error(RequestError(404, f"no such endpoint: {self.command} {self.route}"))
        else:
            self._send_error(RequestError(405, f"{self.route} takes {allowed}, not {self.command}"),
                             [("Allow", allowed)])

    def _is_get_route(self) -> bool:
        return self.route in GET_ROUTES or self.route.startswith(("/v1/models/", "/models/")) or \
            bool(RESPONSE_ROUTE.fullmatch(self.route))

    do_PUT = do_PATCH = do_OPTIONS = _not_allowed  # noqa: N815 (http.server's naming)

    def do_HEAD(self) -> None:  # noqa: N802
        """A client's probe (Claude Code sends HEAD / first): 200 for the root and the GET
        routes, with no body."""
        try:
            self._check_host()
            if self.route != "/" and not self._is_get_route():
                self._not_allowed()
                return
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
        except RequestError as error:
            self._send_error(error)

    def do_DELETE(self) -> None:  # noqa: N802
        """DELETE /v1/responses/{id}: drop a stored response."""
        try:
            self._check_host()
            found = RESPONSE_ROUTE.fullmatch(self.route)
            if found is None:
                self._not_allowed()
                return
            if not self.server.responses.store.delete(found["id"]):
                raise not_found(found["id"])
            self._send_json(200, {"id": found["id"], "object": "response", "deleted": True})
        except RequestError as error:
            self._send_error(error)

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        try:
            self._check_host()
            if not self._is_get_route():
                self._not_allowed()
                return
            engine, route = self.server.engine, self.route
            if route == "/health":
                stalled = engine.stalled_for()
                if stalled > self.server.stall_seconds:
                    self._send_json(503, dict(status="stalled", seconds_without_progress=round(stalled, 1),
                                              **self.server.counts))
                else:
                    self._send_json(200, dict(status="ok", **self.server.counts))
            elif route == "/metrics":
                self._send_metrics()
            elif RESPONSE_ROUTE.fullmatch(route):
                response_id = RESPONSE_ROUTE.fullmatch(route)["id"]
                held = self.server.responses.store.get(response_id)
                if held is None:
                    raise not_found(response_id)
                self._send_json(200, held[0])
            elif route in ("/v1/models", "/models"):
                self._send_json(200, {"object": "list", "data": [self.server.model_card()]})
            elif route.split("/models/", 1)[1] == engine.name:
                self._send_json(200, self.server.model_card())
            else:
                raise RequestError(404, f"no model {route.split('/models/', 1)[1]!r}; this server has {engine.name!r}",
                                   "model", "model_not_found")
        except RequestError as error:
            self._send_error(error)

    def do_POST(self) -> None:  # noqa: N802
        began, request = time.monotonic(), None
        self.status, self.last, self.first_token_seconds, self.gaps = 200, None, None, []
        try:
            body = self._read_body()  # first, so that the client hears whatever the answer is
            self._check_host()
            if self.route not in POST_ROUTES:
                self._not_allowed()
                return
            content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
            if content_type != "application/json":
                raise RequestError(415, f"send the body as application/json, not {content_type or 'untyped'}")
            kind, body = POST_ROUTES[self.route], self._parse_json(body)
            protocol = self.server.protocols.get(kind)
            if kind == "count_tokens":
                self._send_json(200, self.server.protocols["messages"].count(body, self.server.engine))
                return
            if protocol is not None:
                request = protocol.parse(body, self.server.engine, self.server.reply_bound)
            else:
                request = parse_request(body, kind == "chat", self.server.engine, self.server.reply_bound)
            try:  # (said before a stream starts)
                check_budget_alone(self.server.engine.tokenizer, request.options.get("thinking_budget"),
                                   request.options.get("response_format"))
            except UserError as error:
                raise RequestError(400, str(error), "response_format") from None
            self.server.count("requests")
            with self.server.in_flight():
                try:
                    (self._stream if request.stream else self._complete)(request)
                except (BrokenPipeError, ConnectionResetError):
                    # The client left; leaving the loop has cancelled its generation.
                    self.server.count("cancelled")
                    raise
        except RequestError as error:
            self._send_error(error)
        except UserError as error:
            self._send_error(RequestError(400, str(error)))
        except Busy as error:
            self._send_error(RequestError(429, str(error), code="rate_limit_exceeded"),
                             [("Retry-After", str(error.retry_after))])
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
            self.status = 499  # (nginx's name for a client that left before its reply)
        except Exception as error:  # a bug of ours: say so, keep serving
            self.log_error("error serving %s: %r", self.path, error)
            self._send_error(RequestError(500, f"internal error: {error}"))
        finally:
            self._observe(request, time.monotonic() - began)

    def _observe(self, request: Optional[Request], seconds: float) -> None:
        """The request, ended, in the metrics (and its line with --log-requests)."""
        route = self.route if self.route in POST_ROUTES else "other"
        self.server.metrics.observe(route, self.status, seconds, self.last, self.first_token_seconds, self.gaps)
        if self.server.log_requests:
            tokenizer = self.server.engine.tokenizer
            log_line(sys.stderr, self.request_id, route, self.status, seconds, self.last, self.first_token_seconds,
                     usage(self.last, len(request.ids), self.first_token_seconds) if request and self.last else None,
                     tokenizer.decode(request.ids) if self.server.log_text and request else None,
                     self.reply_text if self.server.log_text and request else None)

    def _send_metrics(self) -> None:
        data = self.server.metrics.text()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _read_body(self) -> bytes:
        """The body Content-Length declares. Any problem with it ends the connection too:
        where the next request would start is not known."""
        self.close_connection = True
        header = self.headers.get("Content-Length")
        if header is None:
            raise RequestError(411, "a Content-Length header is required")
        if not CONTENT_LENGTH.fullmatch(header.strip()):
            raise RequestError(400, f"Content-Length must be a number of bytes, not {header[:20]!r}")
        length = int(header)
        try:
            if length > self.server.max_body:
                if length <= 64 * self.server.max_body:  # read it, so the client hears the answer
                    for start in range(0, length, 1 << 16):
                        self.rfile.read(min(1 << 16, length - start))
                raise RequestError(413, f"the request body is {length} bytes; at most {self.server.max_body} "
                                        "are accepted")
            body = self.rfile.read(length)
        except TimeoutError:
            raise RequestError(408, f"the request body stopped arriving ({self.timeout:g} s without a byte); "
                                    "send all of the bytes Content-Length declares") from None
        if len(body) < length:
            raise RequestError(400, f"the connection closed after {len(body)} of the {length} bytes "
                                    "Content-Length declares")
        self.close_connection = False
        return body

    @staticmethod
    def _parse_json(raw: bytes) -> Any:
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise RequestError(400, f"the request body is not valid JSON ({type(exc).__name__})") from None

    def _read_side_closed(self) -> bool:
        """True once the client has shut its sending side (a readable socket with nothing to
        read). It may be waiting for the reply (``nc -N``), or gone: only a write tells."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            raise ConnectionResetError("the connection failed") from None

    def _generate(self, request: Request, on_prompt_read=None, on_wait=None) -> Iterator[GenerationResponse]:
        """The engine's responses (a chat reply's split into answer text, reasoning and tool
        calls), the request queued at once (errors.Busy: no seat and the queue full); the
        caller's writes find a departed client (a broken pipe ends the loop, and so cancels
        the generation)."""
        from .replies import split_reply

        self.arrived, self.first_token_seconds, self.last, self.gaps = time.monotonic(), None, None, []
        self.request_id, self.reply_text = uuid.uuid4().hex[:24], ""
        responses = self.server.engine.generate(request.ids, tree=self.server.tree, history_key=request.model,
                                                on_prompt_read=on_prompt_read, on_wait=on_wait, **request.options)
        return self._watched(split_reply(responses, request.splitter) if request.chat else responses)

    def _watched(self, responses: Iterator[GenerationResponse]) -> Iterator[GenerationResponse]:
        for response in responses:
            now = time.monotonic()
            if self.first_token_seconds is None:
                self.first_token_seconds = now - self.arrived
            else:
                self.gaps.append(now - self.token_at)
            self.last, self.token_at = response, now
            if self.server.log_text:
                self.reply_text += getattr(response, "reasoning", "") + response.text
            yield response
            if not self.read_closed and self._read_side_closed():
                self.read_closed = self.close_connection = True

    def _envelope(self, request: Request, kind: str) -> Dict[str, Any]:
        prefix = "chatcmpl" if request.chat else "cmpl"
        return {"id": f"{prefix}-{uuid.uuid4().hex[:24]}", "object": kind, "created": int(time.time()),
                "model": self.server.engine.name}

    def _cut_off(self, last: Optional[GenerationResponse]) -> Optional[RequestError]:
        """The error for a generation that ended without a finish reason: the server
        stopping under it."""
        if last is not None and last.finish_reason is not None:
            return None
        self.status = 503
        return RequestError(503, "the server is shutting down: the reply was cut off; send the request again")

    def _beat(self) -> None:
        """For a plain reply to a client whose read side has closed: the status line, then a
        space each round, so that a client that has gone breaks the pipe (and so cancels)."""
        if not self.heartbeat:
            self.heartbeat = True
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Connection", "close")  # the body ends when the connection does
            self.end_headers()
        self.wfile.write(b" ")
        self.wfile.flush()

    def _complete(self, request: Request) -> None:
        collected, logprobs = Collected(), []
        tokenizer = self.server.engine.tokenizer

        def reading(read: int, total: int) -> None:
            # After each chunk of a long prompt: a client whose read side has closed gets the
            # heartbeat's space, and one that has gone breaks the pipe, which cancels the reading.
            if self.read_closed or self._read_side_closed():
                self.read_closed = self.close_connection = True
                self._beat()

        for piece in self._generate(request, reading, lambda: reading(0, 0)):
            collected.add(piece)
            if request.top_logprobs is not None:
                logprobs.append(token_logprobs(tokenizer, piece, request.top_logprobs))
            if self.read_closed:
                self._beat()
        error = self._cut_off(collected.last)
        if error is not None:
            if not self.heartbeat:  # else the body stops short: not JSON, so never taken for a reply
                self._send_error(error)
            return
        counts = usage(collected.last, len(request.ids), self.first_token_seconds)
        if request.protocol is not None:
            payload = request.protocol.reply(request, collected, counts)
        else:
            payload = self._openai_reply(request, collected, logprobs)
            payload["usage"] = counts
        if self.heartbeat:
            self.wfile.write(json.dumps(payload).encode())
        else:
            self._send_json(200, payload)

    def _openai_reply(self, request: Request, collected: Collected, logprobs: List[Dict[str, Any]]) -> Dict[str, Any]:
        """A whole chat completion or completion, but for its usage."""
        text, calls, finish = collected.text, collected.calls, collected.last.finish_reason
        if request.chat:
            payload = self._envelope(request, "chat.completion")
            message: Dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
            if collected.reasoning:
                message["reasoning_content"] = collected.reasoning
            if calls:
                message["tool_calls"] = [call.openai() for call in calls]
            payload["choices"] = [{"index": 0, "message": message, "finish_reason": finish,
                                   "logprobs": {"content": logprobs} if request.top_logprobs is not None else None}]
        else:
            payload = self._envelope(request, "text_completion")
            payload["choices"] = [{"index": 0, "text": text, "finish_reason": finish,
                                   "logprobs": completion_logprobs(logprobs) if request.top_logprobs is not None
                                   else None}]
        return payload

    def _start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")  # the stream ends when the connection does
        self.end_headers()
        self.close_connection = True

    def _write(self, data: bytes) -> None:
        self.wfile.write(data)
        self.wfile.flush()

    def _stream_protocol(self, request: Request, protocol: Protocol) -> None:
        """A streamed reply in another protocol's events (protocols/); its keep-alive after
        each chunk of a long prompt and every few seconds of waiting for a seat, whose write
        finds a departed client (which cancels the request)."""
        responses = self._generate(request, lambda read, total: self._write(protocol.keepalive(request, total)),
                                   lambda: self._write(protocol.keepalive(request)))
        self._start_stream()
        try:
            for data in protocol.events(request, responses,
                                        lambda last: usage(last, len(request.ids), self.first_token_seconds)):
                self._write(data)
            cut = self._cut_off(self.last)
            if cut is not None:
                self._write(protocol.stream_error(cut))
        except (BrokenPipeError, ConnectionResetError):
            raise
        except Exception as error:  # the status line is out: report it in the stream
            self.log_error("error streaming %s: %r", self.path, error)
            self._write(protocol.stream_error(RequestError(500, f"internal error: {error}")))

    def _stream(self, request: Request) -> None:
        if request.protocol is not None:
            self._stream_protocol(request, request.protocol)
            return
        envelope = self._envelope(request, "chat.completion.chunk" if request.chat else "text_completion")
        # An SSE comment (clients skip it) after each chunk of a long prompt, and every few
        # seconds while the request waits for a seat: a client that has gone breaks the
        # pipe, which cancels the request.
        responses = self._generate(request, lambda read, total: self._write(b": reading the prompt\n\n"),
                                   lambda: self._write(b": waiting for a seat\n\n"))
        self._start_stream()

        def event(choice: Optional[Dict[str, Any]], **extra) -> None:
            chunk = dict(envelope, choices=[dict(choice, index=0)] if choice is not None else [], **extra)
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()

        last = None
        try:
            if request.chat:
                event({"delta": {"role": "assistant", "content": ""}, "finish_reason": None})
            calls = 0
            tokenizer = self.server.engine.tokenizer
            for last in responses:
                finish = last.finish_reason
                logprobs = ([token_logprobs(tokenizer, last, request.top_logprobs)]
                            if request.top_logprobs is not None else None)
                if request.chat:
                    delta: Dict[str, Any] = {"content": last.text} if last.text else {}
                    if last.reasoning:
                        delta["reasoning_content"] = last.reasoning
                    if last.tool_calls:
                        delta["tool_calls"] = [call.openai(calls + i) for i, call in enumerate(last.tool_calls)]
                        calls += len(last.tool_calls)
                    event({"delta": delta, "finish_reason": finish,
                           "logprobs": {"content": logprobs} if logprobs is not None else None})
                else:
                    event({"text": last.text, "finish_reason": finish,
                           "logprobs": completion_logprobs(logprobs) if logprobs is not None else None})
            cut = self._cut_off(last)
            if cut is not None:  # no [DONE]: the stream did not finish
                self.wfile.write(f"data: {json.dumps({'error': {'message': cut.message, 'type': 'server_error'}})}\n\n"
                                 .encode())
                return
            if request.include_usage:
                event(None, usage=usage(last, len(request.ids), self.first_token_seconds))
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            raise
        except Exception as error:  # the status line is out: report it in the stream
            self.log_error("error streaming %s: %r", self.path, error)
            event = json.dumps({"error": {"message": str(error), "type": "server_error"}})
            self.wfile.write(f"data: {event}\n\n".encode())


class Server(ThreadingHTTPServer):
    daemon_threads = True
    # Connections waiting to be accepted: socketserver's 5 reset a burst of clients before any
    # handler (or the queue's 429) could answer them; the kernel caps this at its own maximum.
    request_queue_size = max(socket.SOMAXCONN, 4096)

    def __init__(self, address, engine: Optional[Engine] = None, tree: str = "auto",
                 default_max_tokens: Optional[int] = None,
                 max_body: int = MAX_BODY_BYTES, quiet: bool = False, allow_hosts: Sequence[str] = (),
                 idle_seconds: float = IDLE_SECONDS, stall_seconds: float = STALL_SECONDS,
                 responses_store_bytes: int = STORE_BYTES, log_requests: bool = False, log_text: bool = False):
        """Binds ``address`` at once; ``engine`` may come later (load the model after
        the port is known to be free). ``log_requests``: a JSON line per request on standard
        error (``log_text``: with the prompt's and the reply's text)."""
        from .protocols.anthropic import Messages
        from .protocols.responses import Responses

        super().__init__(address, Handler)
        messages = Messages()
        self.responses = Responses(ResponseStore(responses_store_bytes))
        self.protocols: Dict[str, Protocol] = {"messages": messages, "count_tokens": messages,
                                               "responses": self.responses, "infill": Infill()}
        self.log_requests, self.log_text = log_requests or log_text, log_text
        self.metrics = Metrics({
            "requests_waiting": ("Requests waiting for a seat", lambda: self.engine.waiting if self.engine else 0),
            "requests_running": ("Replies in progress", lambda: self.engine.in_progress if self.engine else 0),
            "prompt_cache_bytes": ("What the kept conversations' caches hold",
                                   lambda: self.engine.cache_bytes if self.engine else 0),
            "responses_stored_bytes": ("What stored Responses API responses hold", lambda: self.responses.store.bytes),
        })
        self._drafting: Optional[Dict[str, Any]] = None
        self.engine, self.tree, self.default_max_tokens = engine, tree, default_max_tokens
        self.max_body, self.quiet, self.started = max_body, quiet, int(time.time())
        self.idle_seconds, self.stall_seconds = idle_seconds, stall_seconds
        self.counts = {"requests": 0, "cancelled": 0}  # generations started; ended by a departed client
        self._counting = threading.Condition()
        self._serving = 0  # generations in flight
        bound = str(self.server_address[0]).lower()
        self.allowed_hosts = set(LOCAL_HOSTS) | {h.lower() for h in allow_hosts} | \
            ({bound} if bound not in ("0.0.0.0", "::") else set())

    @property
    def reply_bound(self) -> int:
        """A reply's length when a request gives none: the operator's --max-tokens, else until
        the reply ends or the context is full, as the hosted APIs answer (aider and most chat
        clients send no max_tokens)."""
        return self.default_max_tokens or self.engine.context_length or 1 << 30

    def count(self, what: str) -> None:
        with self._counting:
            self.counts[what] += 1

    def model_card(self) -> Dict[str, Any]:
        """/v1/models' entry: the model, what drafts for it and why any drafter is off (asked
        of the engine's worker once: main asks at startup, while the worker is free)."""
        if self._drafting is None:
            self._drafting = {"drafting": self.engine.drafting, "drafting_off": self.engine.drafting_off}
        return {"id": self.engine.name, "object": "model", "created": self.started, "owned_by": "mlx-eagle",
                "context_length": self.engine.context_length, "max_model_len": self.engine.context_length,
                **self._drafting}

    @contextmanager
    def in_flight(self) -> Iterator[None]:
        with self._counting:
            self._serving += 1
        try:
            yield
        finally:
            with self._counting:
                self._serving -= 1
                self._counting.notify_all()

    def cut_in_flight(self, wait: float = 10.0) -> None:
        """Cancel the generation in progress (its reply ends in an error, not as if
        finished) and give its handler ``wait`` seconds to say so."""
        if self.engine is not None:
            self.engine.cancel()
        deadline = time.monotonic() + wait
        with self._counting:
            while self._serving and time.monotonic() < deadline:
                self._counting.wait(timeout=0.1)
                if self.engine is not None:
                    self.engine.cancel()  # a queued request that started meanwhile


def _stop(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the server as Ctrl-C does: cleanly, exit 0


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = new_parser("mlx_eagle.server", __doc__)
    add_model_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    parser.add_argument("--port", type=int, default=8080, help="port (0: any free one)")
    parser.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                        help="also serve requests addressed to this host name (repeatable); "
                             "by default only localhost and the listening address")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="reply length when a request gives none (default: until the reply ends or the context "
                        "is full, as the hosted APIs answer)")
    parser.add_argument("--idle-seconds", type=float, default=IDLE_SECONDS,
                        help="drop a client silent this long, reading or writing")
    parser.add_argument("--stall-seconds", type=float, default=STALL_SECONDS,
                        help="/health answers 503 \"stalled\" while a generation has made no progress this long")
    add_history_arguments(parser)
    add_kv_arguments(parser)
    parser.add_argument("--prompt-cache-bytes", type=int, default=None, metavar="BYTES",
                        help="what the caches of the conversations kept may hold together (default: twice the "
                        "model's weights, at least 256 MiB, at most an eighth of this machine's memory): a "
                        "request continuing one, or beginning as one did, reads only what is new")
    parser.add_argument("--max-concurrency", type=int, default=MAX_CONCURRENCY, metavar="N",
                        help=f"replies in progress at once, their rounds verified together (default {MAX_CONCURRENCY})")
    parser.add_argument("--max-queue", type=int, default=MAX_QUEUE, metavar="N",
                        help=f"requests waiting for a seat (default {MAX_QUEUE}); past that a request gets a 429 "
                        "with Retry-After")
    parser.add_argument("--responses-store-bytes", type=int, default=STORE_BYTES, metavar="BYTES",
                        help="what stored /v1/responses responses may hold together (default 64 MiB; the least "
                        "recently used go first)")
    parser.add_argument("--escape-special-text", action="store_true",
                        help="special tokens' text typed in chat messages (<|im_end|>, say) stays text instead of "
                        "becoming the template's markers: for a server that fronts untrusted users")
    parser.add_argument("--log-requests", action="store_true",
                        help="a JSON line per request on standard error: id, route, status, tokens, times and "
                        "speculation (never the text, unless --log-text)")
    parser.add_argument("--log-text", action="store_true",
                        help="with --log-requests: the prompt's and the reply's text too")
    parser.add_argument("--quiet", action="store_true", help="no line per request")
    args = parser.parse_args(argv)
    from .distributed import rank, sharding
    from .plan import user_drafter
    from .session import Engine
    from .target import kv_quantization

    # Everything that can be wrong with the arguments is said before the model loads.
    if args.tree != "auto":
        parse_tree(args.tree)
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port {args.port} is not a port; give 1 to 65535, or 0 for any free one")
    if args.max_tokens is not None:
        check_options(args.max_tokens, None)
    for flag, seconds in (("--idle-seconds", args.idle_seconds), ("--stall-seconds", args.stall_seconds)):
        if not 0 < seconds <= 86400:
            raise UserError(f"{flag} {seconds:g} is out of range; give seconds above 0, up to 86400")
    if args.max_concurrency < 1 or args.max_queue < 0:
        raise UserError(f"--max-concurrency must be 1 or more and --max-queue 0 or more, not "
                        f"{args.max_concurrency} and {args.max_queue}")
    if args.prompt_cache_bytes is not None and args.prompt_cache_bytes < 0:
        raise UserError(f"--prompt-cache-bytes must be 0 or more, not {args.prompt_cache_bytes}")
    if args.responses_store_bytes < 0:
        raise UserError(f"--responses-store-bytes must be 0 or more, not {args.responses_store_bytes}")
    if args.log_text and not args.log_requests:
        raise UserError("--log-text adds the text to --log-requests' lines; give --log-requests too")
    kv_quantization(**kv_options(args))
    user_drafter(args.draft)  # your own drafter, imported now: one line if it cannot be
    history = history_choice(args)

    def make_engine() -> Engine:
        return Engine(args.model, args.draft, tree=args.tree, history=history, lookup=not args.no_lookup,
                      prompt_cache_bytes=args.prompt_cache_bytes, pipeline=args.pipeline,
                      max_concurrency=args.max_concurrency, max_queue=args.max_queue,
                      escape_special_text=args.escape_special_text, **kv_options(args))

    if rank():  # a sharded model: rank 0 serves, this rank does what its engine does
        make_engine().follow()
        return
    try:
        server = Server((args.host, args.port), None, args.tree, args.max_tokens, quiet=args.quiet,
                        allow_hosts=args.allow_host, idle_seconds=args.idle_seconds, stall_seconds=args.stall_seconds,
                        responses_store_bytes=args.responses_store_bytes, log_requests=args.log_requests,
                        log_text=args.log_text)
    except (OSError, OverflowError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise UserError(f"cannot listen on {args.host}:{args.port} ({reason}); pick another --port or --host") from None
    try:
        server.engine = engine = make_engine()
    except BaseException:
        server.server_close()
        raise
    host, port = server.server_address[:2]
    try:
        exposed = not ipaddress.ip_address(host).is_loopback
    except ValueError:
        exposed = True
    if exposed:
        print(f"warning: listening on {host}, reachable from other machines; the API has no authentication",
              file=sys.stderr)
    card = server.model_card()  # (what drafts, asked now: a worker busy later would keep /v1/models waiting)
    shards = f", {sharding(engine.model)}" if sharding(engine.model) else ""
    together = (f"up to {args.max_concurrency} requests at once, their rounds verified together" if engine.batches
                else f"up to {args.max_concurrency} requests at once, their rounds one after another (this model's "
                "cannot share a forward pass)" if args.max_concurrency > 1 and not engine.shards
                else "one request at a time")
    print(f"serving {engine.name} ({card['drafting']}{shards}; {together}) at http://{host}:{port}/v1",
          file=sys.stderr, flush=True)
    if not LAUNCHED:  # (under mlx.launch, SIGTERM means another rank ended: cli.py ends this one at once)
        signal.signal(signal.SIGTERM, _stop)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopping: replies in flight are cut off", file=sys.stderr)
    finally:
        # Within STOP_SECONDS with margin: the handlers' last words, then the worker, then exit.
        deadline = time.monotonic() + STOP_SECONDS - 3
        server.server_close()  # no new connections
        server.cut_in_flight(wait=STOP_SECONDS / 3)
        if not engine.close(wait=max(0.0, deadline - time.monotonic())):
            # A model or drafter call that never returns: nothing can end it but the process.
            print("stopped: the generation in progress did not stop in time", file=sys.stderr, flush=True)
            os._exit(1)
        print("stopped", file=sys.stderr)


def cli() -> None:
    """Console-script entry point."""
    run_cli(main)


if __name__ == "__main__":
    cli()
