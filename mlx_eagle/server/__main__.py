"""The server's command: ``python -m mlx_eagle.server`` (a module of its own, as
``mlx_eagle.generate``'s is, so that its arguments are checked, and --help answered, before
any model code loads)."""

from __future__ import annotations

import ipaddress
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Optional, Sequence

from ..cli import LAUNCHED, add_history_arguments, add_kv_arguments, add_model_arguments, history_choice, kv_options, \
    new_parser, run_cli
from ..errors import MAX_CONCURRENCY, MAX_QUEUE, PROMPT_DISK_BYTES, UserError
from ..protocols.store import STORE_BYTES
from ..trees import parse_tree
from . import IDLE_SECONDS, STALL_SECONDS, STOP_SECONDS, Server
from . import __doc__ as SERVER_DOC

if TYPE_CHECKING:
    from ..engine import Engine


def _stop(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the server as Ctrl-C does: cleanly, exit 0


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = new_parser("mlx_eagle.server", SERVER_DOC)
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
    parser.add_argument("--prompt-disk-bytes", type=int, default=PROMPT_DISK_BYTES, metavar="BYTES",
                        help="what long prompts' caches kept on disk may hold (default 8 GiB; 0: none kept): a "
                        "restarted server, or an agent's next session, does not read them again "
                        "(docs/usage.md#agent-clients)")
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
    from ..distributed import rank, sharding
    from ..plan import user_drafter
    from ..engine import Engine
    from ..target import kv_quantization

    # Everything that can be wrong with the arguments is said before the model loads.
    if args.tree != "auto":
        parse_tree(args.tree)
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port {args.port} is not a port; give 1 to 65535, or 0 for any free one")
    if args.max_tokens is not None:
        from ..options import ReplyOptions

        ReplyOptions(max_tokens=args.max_tokens)
    for flag, seconds in (("--idle-seconds", args.idle_seconds), ("--stall-seconds", args.stall_seconds)):
        if not 0 < seconds <= 86400:
            raise UserError(f"{flag} {seconds:g} is out of range; give seconds above 0, up to 86400")
    if args.max_concurrency < 1 or args.max_queue < 0:
        raise UserError(f"--max-concurrency must be 1 or more and --max-queue 0 or more, not "
                        f"{args.max_concurrency} and {args.max_queue}")
    if args.prompt_cache_bytes is not None and args.prompt_cache_bytes < 0:
        raise UserError(f"--prompt-cache-bytes must be 0 or more, not {args.prompt_cache_bytes}")
    if args.prompt_disk_bytes < 0:
        raise UserError(f"--prompt-disk-bytes must be 0 or more, not {args.prompt_disk_bytes}")
    if args.responses_store_bytes < 0:
        raise UserError(f"--responses-store-bytes must be 0 or more, not {args.responses_store_bytes}")
    if args.log_text and not args.log_requests:
        raise UserError("--log-text adds the text to --log-requests' lines; give --log-requests too")
    kv_quantization(**kv_options(args))
    user_drafter(args.draft)  # your own drafter, imported now: one line if it cannot be
    history = history_choice(args)

    def make_engine() -> Engine:
        return Engine(args.model, args.draft, tree=args.tree, history=history, lookup=not args.no_lookup,
                      prompt_cache_bytes=args.prompt_cache_bytes, prompt_disk_bytes=args.prompt_disk_bytes,
                      pipeline=args.pipeline,
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
    engine.time_batches()
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
