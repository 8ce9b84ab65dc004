"""A logging reverse proxy: what a real client sends, kept as JSON lines, while its replies
pass through untouched (streamed ones as they come). How the fixtures in tests/fixtures/
were captured:

    python benchmarks/capture_requests.py --upstream http://127.0.0.1:8080 --port 8090 --out requests.jsonl
    OPENAI_BASE_URL=http://127.0.0.1:8090/v1 some-agent ...

Each line: {"client", "method", "path", "headers", "body"} (the body parsed where it is JSON).
"""

from __future__ import annotations

import argparse
import http.client
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Tuple
from urllib.parse import urlsplit

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host",
              "proxy-authorization", "proxy-authenticate", "content-length"}


def serve(upstream: str, port: int, out: Path, client: str = "") -> Tuple[ThreadingHTTPServer, threading.Thread]:
    """The proxy on 127.0.0.1:``port`` (0: any free one), in a thread of its own; each request
    appended to ``out``."""
    target = urlsplit(upstream)
    lock = threading.Lock()

    class Proxy(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _forward(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = raw.decode("utf-8", "replace")
            with lock, out.open("a") as log:
                log.write(json.dumps({"client": client, "method": self.command, "path": self.path,
                                      "headers": dict(self.headers.items()), "body": body}) + "\n")
            upstream_connection = http.client.HTTPConnection(target.hostname, target.port, timeout=3600)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
            headers["Accept-Encoding"] = "identity"  # passed through as it comes, not re-encoded
            upstream_connection.request(self.command, self.path, body=raw or None, headers=headers)
            reply = upstream_connection.getresponse()
            self.send_response(reply.status)
            for key, value in reply.getheaders():
                if key.lower() not in HOP_BY_HOP:
                    self.send_header(key, value)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while True:
                piece = reply.read1(65536) if self.command != "HEAD" else b""
                if not piece:
                    break
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            upstream_connection.close()

        do_GET = do_POST = do_HEAD = do_DELETE = _forward

    server = ThreadingHTTPServer(("127.0.0.1", port), Proxy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help="the server's base URL, e.g. http://127.0.0.1:8080")
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument("--out", type=Path, required=True, help="the JSON lines file requests are appended to")
    parser.add_argument("--client", default="", help="a name written with each request")
    args = parser.parse_args()
    server, thread = serve(args.upstream, args.port, args.out, args.client)
    print(f"capturing at http://127.0.0.1:{server.server_address[1]} into {args.out}", flush=True)
    try:
        thread.join()
    except KeyboardInterrupt:
        server.shutdown()


if __name__ == "__main__":
    main()
