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
generation within two rounds (or chunks) either way.

What each API takes and answers, and how its errors read: protocols/ (openai.py, anthropic.py,
responses.py, infill.py). A field that is wrong gets a 400 naming it (``param``).
"""

from __future__ import annotations

import json
import re
import select
import socket
import sys
import threading
import time
from contextlib import contextmanager
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, Optional, Sequence, Tuple


from ..errors import Busy, UserError
from ..metrics import CONTENT_TYPE, Metrics, Telemetry, log_line
from ..protocols import Collected, Protocol, Request, RequestError, usage
from ..protocols.store import STORE_BYTES, ResponseStore, not_found

if TYPE_CHECKING:  # they load mlx-lm: imported where used, so that --help answers at once
    from ..generation import GenerationResponse
    from ..engine import Engine

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


def read_body(rfile, headers, max_body: int, timeout: float) -> bytes:
    """The body Content-Length declares, at most ``max_body`` bytes (``timeout``: the
    seconds a client may go silent, said in the 408)."""
    header = headers.get("Content-Length")
    if header is None:
        raise RequestError(411, "a Content-Length header is required")
    if not CONTENT_LENGTH.fullmatch(header.strip()):
        raise RequestError(400, f"Content-Length must be a number of bytes, not {header[:20]!r}")
    length = int(header)
    try:
        if length > max_body:
            if length <= 64 * max_body:  # read it, so the client hears the answer
                for start in range(0, length, 1 << 16):
                    rfile.read(min(1 << 16, length - start))
            raise RequestError(413, f"the request body is {length} bytes; at most {max_body} are accepted")
        body = rfile.read(length)
    except TimeoutError:
        raise RequestError(408, f"the request body stopped arriving ({timeout:g} s without a byte); "
                                "send all of the bytes Content-Length declares") from None
    if len(body) < length:
        raise RequestError(400, f"the connection closed after {len(body)} of the {length} bytes "
                                "Content-Length declares")
    return body


def parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise RequestError(400, f"the request body is not valid JSON ({type(exc).__name__})") from None


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "Server"
    read_closed = False  # the client has shut its sending side (it may still be reading)
    heartbeat = False  # a plain reply's status line is out, spaces follow until its JSON
    status = 200  # the status the request in progress was answered with
    telemetry: Telemetry  # the request in progress's times, from its arrival (set by do_POST)

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
        self._send(status, json.dumps(payload).encode(), "application/json", headers)

    def _send(self, status: int, data: bytes, content_type: str, headers: Sequence[tuple] = ()) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _send_error(self, error: RequestError, headers: Sequence[tuple] = ()) -> None:
        """``error`` in the shape of the protocol the route speaks (OpenAI's where none does)."""
        self.status = error.status
        protocol = self.server.protocols.get(POST_ROUTES.get(self.route, ""), self.server.protocols["chat"])
        self._send_json(error.status, protocol.error(error), headers)

    @property
    def route(self) -> str:
        return getattr(self, "path", "").split("?", 1)[0]  # (no path: a request line http.server could not read)

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

    def _serve(self, known: bool, answer: Callable[[], None]) -> None:
        """A GET, HEAD or DELETE: the host checked, then ``answer`` (a route it does not
        know: 404 or 405); a RequestError either raises is the reply."""
        try:
            self.server.check_host(self.headers)
            answer() if known else self._not_allowed()
        except RequestError as error:
            self._send_error(error)

    def do_HEAD(self) -> None:  # noqa: N802
        """A client's probe (Claude Code sends HEAD / first): 200 for the root and the GET
        routes, with no body."""
        self._serve(self.route == "/" or self._is_get_route(), lambda: self._send(200, b"", "application/json"))

    def do_DELETE(self) -> None:  # noqa: N802
        """DELETE /v1/responses/{id}: drop a stored response."""
        found = RESPONSE_ROUTE.fullmatch(self.route)
        self._serve(found is not None, lambda: self._send_json(200, self.server.forget(found["id"])))

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._serve(self._is_get_route(), lambda: self._send(200, self.server.metrics.text(), CONTENT_TYPE)
                    if self.route == "/metrics" else self._send_json(*self.server.answer(self.route)))

    def do_POST(self) -> None:  # noqa: N802
        began, request = time.monotonic(), None
        self.status, self.telemetry = 200, Telemetry(text="" if self.server.log_text else None)
        try:
            self.close_connection = True  # (until the body is read: where the next request starts is unknown)
            body = read_body(self.rfile, self.headers, self.server.max_body, self.timeout)  # first: the client
            self.close_connection = False  # hears whatever the answer is
            self.server.check_host(self.headers)
            if self.route not in POST_ROUTES:
                self._not_allowed()
                return
            content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
            if content_type != "application/json":
                raise RequestError(415, f"send the body as application/json, not {content_type or 'untyped'}")
            kind, body = POST_ROUTES[self.route], parse_json(body)
            if kind == "count_tokens":
                self._send_json(200, self.server.protocols["messages"].count(body, self.server.engine))
                return
            request = self.server.protocols[kind].parse(body, self.server.engine, self.server.reply_bound)
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
        except UserError as error:  # a check that names the request's field (as far as its first . or [)
            field = re.split(r"[.\[]", error.field, maxsplit=1)[0] if error.field else None
            self._send_error(RequestError(400, str(error), field))
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
            self.server.observe(self.route, self.status, time.monotonic() - began, self.telemetry, request)

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
        from ..replies import split_reply

        responses = self.server.engine.generate(request.ids, request.options, tree=self.server.tree,
                                                history_key=request.model, on_prompt_read=on_prompt_read,
                                                on_wait=on_wait)
        return self._watched(split_reply(responses, request.splitter) if request.chat else responses)

    def _watched(self, responses: Iterator[GenerationResponse]) -> Iterator[GenerationResponse]:
        for response in responses:
            self.telemetry.see(response)
            yield response
            if not self.read_closed and self._read_side_closed():
                self.read_closed = self.close_connection = True

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
        collected = Collected()

        def reading(read: int, total: int) -> None:
            # After each chunk of a long prompt: a client whose read side has closed gets the
            # heartbeat's space, and one that has gone breaks the pipe, which cancels the reading.
            if self.read_closed or self._read_side_closed():
                self.read_closed = self.close_connection = True
                self._beat()

        for piece in self._generate(request, reading, lambda: reading(0, 0)):
            request.protocol.collect(request, collected, piece)
            if self.read_closed:
                self._beat()
        error = self._cut_off(collected.last)
        if error is not None:
            if not self.heartbeat:  # else the body stops short: not JSON, so never taken for a reply
                self._send_error(error)
            return
        payload = request.protocol.reply(request, collected,
                                         usage(collected.last, len(request.ids), self.telemetry.first_token_seconds))
        if self.heartbeat:
            self.wfile.write(json.dumps(payload).encode())
        else:
            self._send_json(200, payload)

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

    def _stream(self, request: Request) -> None:
        """A streamed reply in its protocol's events; its keep-alive after each chunk of a long
        prompt and every few seconds of waiting for a seat, whose write finds a departed client
        (which cancels the request)."""
        protocol = request.protocol
        responses = self._generate(request, lambda read, total: self._write(protocol.keepalive(request, total)),
                                   lambda: self._write(protocol.keepalive(request)))
        self._start_stream()
        try:
            for data in protocol.events(request, responses, lambda last: usage(
                    last, len(request.ids), self.telemetry.first_token_seconds)):
                self._write(data)
            cut = self._cut_off(self.telemetry.last)
            if cut is not None:
                self._write(protocol.stream_error(cut))
        except (BrokenPipeError, ConnectionResetError):
            raise
        except Exception as error:  # the status line is out: report it in the stream
            self.log_error("error streaming %s: %r", self.path, error)
            self._write(protocol.stream_error(RequestError(500, f"internal error: {error}")))


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
        from ..protocols.anthropic import Messages
        from ..protocols.infill import Infill
        from ..protocols.openai import ChatCompletions, Completions
        from ..protocols.responses import Responses

        super().__init__(address, Handler)
        messages = Messages()
        self.responses = Responses(ResponseStore(responses_store_bytes))
        self.protocols: Dict[str, Protocol] = {"chat": ChatCompletions(), "completions": Completions(),
                                               "messages": messages, "count_tokens": messages,
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

    def check_host(self, headers) -> None:
        """403 unless the Host header names this machine (or an allowed name)."""
        host = (headers.get("Host") or "").strip().lower()
        parsed = HOST_HEADER.fullmatch(host)
        name = parsed.group("name").strip("[]") if parsed else host
        if parsed is None or name not in self.allowed_hosts:
            raise RequestError(403, f"host {name or '(none)'!r} is not allowed; start the server with "
                                    f"--allow-host {name or 'NAME'} to serve it")

    def answer(self, route: str) -> Tuple[int, Dict[str, Any]]:
        """A GET route's status and body (/metrics aside)."""
        if route == "/health":
            stalled = self.engine.stalled_for()
            if stalled > self.stall_seconds:
                return 503, dict(status="stalled", seconds_without_progress=round(stalled, 1), **self.counts)
            return 200, dict(status="ok", **self.counts)
        if RESPONSE_ROUTE.fullmatch(route):
            response_id = RESPONSE_ROUTE.fullmatch(route)["id"]
            held = self.responses.store.get(response_id)
            if held is None:
                raise not_found(response_id)
            return 200, held[0]
        if route in ("/v1/models", "/models"):
            return 200, {"object": "list", "data": [self.model_card()]}
        if route.split("/models/", 1)[1] == self.engine.name:
            return 200, self.model_card()
        raise RequestError(404, f"no model {route.split('/models/', 1)[1]!r}; this server has {self.engine.name!r}",
                           "model", "model_not_found")

    def forget(self, response_id: str) -> Dict[str, Any]:
        """DELETE /v1/responses/{id}: drop a stored response."""
        if not self.responses.store.delete(response_id):
            raise not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    def observe(self, route: str, status: int, seconds: float, telemetry: Telemetry,
                request: Optional[Request]) -> None:
        """A request, ended, in the metrics (and its line with --log-requests)."""
        route = route if route in POST_ROUTES else "other"
        self.metrics.observe(route, status, seconds, telemetry)
        if self.log_requests:
            last = telemetry.last
            log_line(sys.stderr, route, status, seconds, telemetry,
                     usage(last, len(request.ids), telemetry.first_token_seconds) if request and last else None,
                     self.engine.tokenizer.decode(request.ids) if telemetry.text is not None and request else None)

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
