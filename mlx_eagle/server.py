"""An OpenAI-compatible HTTP server on this machine, EAGLE-accelerated.

    python -m mlx_eagle.server [--model M] [--draft D] [--port 8080]

Serves /v1/chat/completions and /v1/completions (streamed or not), /v1/models and
/health on 127.0.0.1 by default. One model and head are loaded once; requests are
served in turn. A client that disconnects cancels its generation. Speculation
statistics come in each response's ``usage.speculation``.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import select
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, Iterator, List, Optional, Sequence

from .cli import DRAFT_HELP, UserError, run_cli
from .generation import GenerationResponse, chat_tokens
from .session import Engine

MAX_BODY_BYTES = 1 << 20


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
    include_usage: bool
    options: Dict[str, Any] = field(default_factory=dict)


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise RequestError(400, f"{name} must be a number from {low:g} to {high:g}", name)
    return float(value)


def _content(message: dict, index: int) -> str:
    """Message content: a string, or OpenAI's list of text parts."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise RequestError(400, f"messages[{index}].content must be a string or a list of text parts", "messages")


def _messages(body: dict) -> List[Dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant"):
            raise RequestError(400, f"messages[{index}].role must be system, user or assistant", "messages")
        out.append({"role": role, "content": _content(message, index)})
    return out


def _prompt(body: dict, tokenizer) -> List[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise RequestError(400, "prompt must be a non-empty string (or one list of token ids)", "prompt")


def parse_request(body: Any, chat: bool, engine: Engine, default_max_tokens: int) -> Request:
    """Check a request body field by field; the first problem becomes a RequestError."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    limit = engine.context_length or 1 << 30
    ids = chat_tokens(engine.tokenizer, _messages(body)) if chat else _prompt(body, engine.tokenizer)
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
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError(400, "seed must be an integer", "seed")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, "stream must be true or false", "stream")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise RequestError(400, "stream_options must be an object", "stream_options")
    options = dict(max_tokens=max_tokens, temp=_number(body, "temperature", 0.0, 0.0, 2.0),
                   top_p=_number(body, "top_p", 1.0, 0.0, 1.0), seed=seed, stop=stop)
    if options["top_p"] == 0.0:
        raise RequestError(400, "top_p must be above 0", "top_p")
    return Request(ids=ids, chat=chat, stream=stream, include_usage=bool(stream_options.get("include_usage")),
                   options=options)


def usage(last: Optional[GenerationResponse], prompt_tokens: int) -> Dict[str, Any]:
    completion = last.generation_tokens if last is not None else 0
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": last.prompt_reused if last is not None else 0},
        "speculation": {
            "mean_accepted_tokens": last.mean_accepted if last is not None else 0.0,
            "target_forwards": last.target_forwards if last is not None else 0,
            "tokens_per_second": last.generation_tps if last is not None else 0.0,
        },
    }


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "Server"
    client_left = False

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base class's name)
        if not self.server.quiet:
            sys.stderr.write(f"{self.address_string()} {format % args}\n")

    def _send_json(self, status: int, payload: Dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, error: RequestError) -> None:
        self._send_json(error.status, {"error": {"message": error.message, "type": "invalid_request_error",
                                                 "param": error.param, "code": error.code}})

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path == "/health":
            self._send_json(200, dict(status="ok", **self.server.counts))
        elif self.path in ("/v1/models", "/models"):
            engine = self.server.engine
            self._send_json(200, {"object": "list", "data": [
                {"id": engine.name, "object": "model", "created": self.server.started, "owned_by": "mlx-eagle"}]})
        else:
            self._send_error(RequestError(404, f"no such endpoint: GET {self.path}"))

    def do_POST(self) -> None:  # noqa: N802
        routes = {"/v1/chat/completions": True, "/chat/completions": True,
                  "/v1/completions": False, "/completions": False}
        try:
            if self.path not in routes:
                raise RequestError(404, f"no such endpoint: POST {self.path}")
            request = parse_request(self._read_json(), routes[self.path], self.server.engine,
                                    self.server.default_max_tokens)
            self.server.count("requests")
            if request.stream:
                self._stream(request)
            else:
                self._complete(request)
        except RequestError as error:
            self.close_connection = self.close_connection or error.status in (411, 413)
            self._send_error(error)
        except UserError as error:
            self._send_error(RequestError(400, str(error)))
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as error:  # a bug of ours: say so, keep serving
            self.log_error("error serving %s: %r", self.path, error)
            self._send_json(500, {"error": {"message": f"internal error: {error}", "type": "server_error",
                                            "param": None, "code": None}})

    def _read_json(self) -> Any:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise RequestError(411, "a Content-Length header is required")
        if int(length) > self.server.max_body:
            if int(length) <= 64 * self.server.max_body:  # read it, so the client hears the answer
                for start in range(0, int(length), 1 << 16):
                    self.rfile.read(min(1 << 16, int(length) - start))
            raise RequestError(413, f"the request body is {length} bytes; at most {self.server.max_body} are accepted")
        raw = self.rfile.read(int(length))
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise RequestError(400, f"the request body is not valid JSON ({exc})") from None

    def _client_gone(self) -> bool:
        """True once the client has closed its end (a readable socket with nothing to read)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _generate(self, request: Request) -> Iterator[GenerationResponse]:
        """The engine's responses until done or until the client goes away (which ends
        the loop, and so cancels the generation)."""
        for response in self.server.engine.generate(request.ids, tree=self.server.tree, **request.options):
            yield response
            if self._client_gone():
                self.client_left = self.close_connection = True
                self.server.count("cancelled")
                return

    def _envelope(self, request: Request, kind: str) -> Dict[str, Any]:
        prefix = "chatcmpl" if request.chat else "cmpl"
        return {"id": f"{prefix}-{uuid.uuid4().hex[:24]}", "object": kind, "created": int(time.time()),
                "model": self.server.engine.name}

    def _complete(self, request: Request) -> None:
        text, last = "", None
        for last in self._generate(request):
            text += last.text
        if self.client_left:
            return
        finish = (last.finish_reason if last is not None else None) or "stop"
        if request.chat:
            payload = self._envelope(request, "chat.completion")
            payload["choices"] = [{"index": 0, "message": {"role": "assistant", "content": text},
                                   "finish_reason": finish, "logprobs": None}]
        else:
            payload = self._envelope(request, "text_completion")
            payload["choices"] = [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]
        payload["usage"] = usage(last, len(request.ids))
        self._send_json(200, payload)

    def _stream(self, request: Request) -> None:
        envelope = self._envelope(request, "chat.completion.chunk" if request.chat else "text_completion")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")  # the stream ends when the connection does
        self.end_headers()
        self.close_connection = True

        def event(choice: Optional[Dict[str, Any]], **extra) -> None:
            chunk = dict(envelope, choices=[dict(choice, index=0)] if choice is not None else [], **extra)
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()

        last = None
        try:
            if request.chat:
                event({"delta": {"role": "assistant", "content": ""}, "finish_reason": None})
            for last in self._generate(request):
                finish = last.finish_reason
                if request.chat:
                    event({"delta": {"content": last.text} if last.text else {}, "finish_reason": finish})
                else:
                    event({"text": last.text, "finish_reason": finish})
            if request.include_usage:
                event(None, usage=usage(last, len(request.ids)))
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            # The client left; leaving the loop has cancelled its generation.
            if not self.client_left:
                self.server.count("cancelled")
        except Exception as error:  # the status line is out: report it in the stream
            self.log_error("error streaming %s: %r", self.path, error)
            self.wfile.write(f"data: {json.dumps({'error': {'message': str(error), 'type': 'server_error'}})}\n\n".encode())


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address, engine: Engine, tree: str = "auto", default_max_tokens: int = 512,
                 max_body: int = MAX_BODY_BYTES, quiet: bool = False):
        super().__init__(address, Handler)
        self.engine, self.tree, self.default_max_tokens = engine, tree, default_max_tokens
        self.max_body, self.quiet, self.started = max_body, quiet, int(time.time())
        self.counts = {"requests": 0, "cancelled": 0}  # generations started; ended by a departed client
        self._counting = threading.Lock()

    def count(self, what: str) -> None:
        with self._counting:
            self.counts[what] += 1


def _stop(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the server as Ctrl-C does: cleanly, exit 0


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mlx_eagle.server", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="MLX or Hugging Face directory, .gguf file or repo id "
                                        "(default: SmolLM2-135M-Instruct)")
    parser.add_argument("--draft", default="auto", help=DRAFT_HELP)
    parser.add_argument("--tree", default="auto", help="draft tree (as in mlx_eagle.generate)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    parser.add_argument("--port", type=int, default=8080, help="port (0: any free one)")
    parser.add_argument("--max-tokens", type=int, default=512, help="reply length when a request gives none")
    parser.add_argument("--quiet", action="store_true", help="no line per request")
    args = parser.parse_args(argv)
    from .trees import parse_tree

    if args.tree != "auto":
        parse_tree(args.tree)
    engine = Engine(args.model, args.draft)
    try:
        server = Server((args.host, args.port), engine, args.tree, args.max_tokens, quiet=args.quiet)
    except OSError as exc:
        raise UserError(f"cannot listen on {args.host}:{args.port} ({exc.strerror}); pick another --port") from None
    host, port = server.server_address[:2]
    try:
        exposed = not ipaddress.ip_address(host).is_loopback
    except ValueError:
        exposed = True
    if exposed:
        print(f"warning: listening on {host}, reachable from other machines; the API has no authentication",
              file=sys.stderr)
    print(f"serving {engine.name} ({engine.drafting}) at http://{host}:{port}/v1", file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, _stop)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
    finally:
        server.server_close()
        engine.close()


def cli() -> None:
    """Console-script entry point."""
    run_cli(main)


if __name__ == "__main__":
    cli()
