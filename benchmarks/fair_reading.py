"""A short request's time to first token while another request's long prompt is read (an
agent's 27k-token first turn), on one Engine as the server runs it, three ways side by side at
each depth of the long reading: the long prompt read in chunks of 512 tokens whatever else
waits (no time bound), in passes of about ``PASS_SECONDS`` (0.5 s, the default), and in
passes of 2 s while it is read alone (``ALONE_PASS_SECONDS``), 0.5 s while others are live.

    python benchmarks/fair_reading.py [--model GGUF_OR_DIR] [--long 27000] [--short 200]
        [--depths 2048,8192,16384,24576] [--out benchmarks/results/fair_reading.json]

The long prompt is read once: when its reading passes each depth, a short request (a new
prompt of ``--short`` tokens, one token asked for) is sent under each rule in turn, just as
a pass of the long prompt under that rule begins (the worst case: a request that arrives
later waits for less of it), and its time to first token measured, with the pace of the
long prompt's reading alone in the pass before (what the rule costs it); the long request
then leaves. A table on standard output, the JSON in ``--out``.
"""

import argparse
import json
import math
import sys
import threading
import time
from pathlib import Path
from typing import List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent import add_model_argument  # noqa: E402

from mlx_eagle import scheduler  # noqa: E402
from mlx_eagle.cli import use_fast_blas  # noqa: E402
from mlx_eagle.models import resolve_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# Each rule's pass bounds: (while others are live or waiting, while a prompt is read alone).
DEFAULT = "passes of 0.5 s (default)"
RULES = {"512-token chunks": (math.inf, math.inf), DEFAULT: (scheduler.PASS_SECONDS, scheduler.ALONE_PASS_SECONDS),
         "passes of 0.5 s, 2 s alone": (scheduler.PASS_SECONDS, 2.0)}


def use_rule(rule: str) -> None:
    scheduler.PASS_SECONDS, scheduler.ALONE_PASS_SECONDS = RULES[rule]


class Left(Exception):
    """The long request leaves once every depth is measured."""


def texts(tokenizer, length: int, count: int) -> List[List[int]]:
    """``count`` different prompts of ``length`` tokens: pieces of this package's source."""
    source = " ".join(p.read_text() for p in sorted((ROOT / "mlx_eagle").rglob("*.py")))
    ids = tokenizer.encode(source)
    if len(ids) < length * count:
        ids = ids * (length * count // len(ids) + 1)
    return [ids[i * length:(i + 1) * length] for i in range(count)]


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_argument(parser)
    parser.add_argument("--long", type=int, default=27000, help="the long prompt's tokens")
    parser.add_argument("--short", type=int, default=200, help="each short request's prompt tokens")
    parser.add_argument("--depths", default="2048,8192,16384,24576",
                        help="how far the long reading has gone when short requests are sent")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "fair_reading.json")
    args = parser.parse_args(argv)
    depths = [int(d) for d in args.depths.split(",")]
    if not depths or max(depths) + 4 * 512 >= args.long:  # (room for each rule's passes before the reading ends)
        raise SystemExit(f"error: --depths must end at least 2,048 tokens before the long prompt's {args.long}")
    use_fast_blas()
    from mlx_eagle.engine import Engine

    engine = Engine(str(resolve_model(args.model)), history=False)
    long_prompt, *shorts = texts(engine.tokenizer, args.long, 1 + len(depths) * len(RULES))
    long_prompt = long_prompt[:args.long]
    reached, done, failed, rows = threading.Condition(), [], [], []
    position = [0, 0.0]  # tokens read, when the last pass ended

    def progress(read: int, total: int) -> None:
        with reached:
            position[0], position[1] = read, time.perf_counter()
            reached.notify_all()
        if done:
            raise Left()

    def read_long() -> None:
        try:
            for _ in engine.generate(long_prompt, max_tokens=1, on_prompt_read=progress):
                pass
        except Left:
            pass
        except Exception as error:  # (reported by the main thread)
            failed.append(error)
        finally:  # (a reading that failed or ended wakes the waits, which see it is over)
            with reached:
                reached.notify_all()

    reader = threading.Thread(target=read_long)
    reader.start()
    try:
        for depth in depths:
            with reached:
                reached.wait_for(lambda depth=depth: position[0] >= depth or not reader.is_alive())
            if failed:
                raise SystemExit(f"error: the long prompt's reading failed: {failed[0]!r}")
            for rule in RULES:
                use_rule(rule)
                with reached:  # the pass in flight, sized under the other rule, ends; then one of this
                    # rule's while the long prompt is read alone (its pace), and the next begins
                    for _ in range(2):
                        (was, ended) = position
                        reached.wait_for(lambda was=was: position[0] > was or not reader.is_alive())
                    pace = (position[0] - was) / max(position[1] - ended, 1e-9)
                short = shorts.pop()[:args.short]
                sent, at, ttft = time.perf_counter(), position[0], None
                for _ in engine.generate(short, max_tokens=1):
                    ttft = ttft or time.perf_counter() - sent
                rows.append({"depth": at, "rule": rule, "short_tokens": len(short), "ttft_s": round(ttft, 3),
                             "long_alone_tokens_per_s": round(pace, 2),
                             "long_still_read": at < len(long_prompt) - 1})  # (else it waited for a round)
                print(f"long prompt read to {at:6} tokens ({pace:5.1f} tokens/s alone) | {rule:36} | "
                      f"{len(short)}-token request's first token after {ttft:6.2f} s", flush=True)
    finally:
        use_rule(DEFAULT)
        done.append(True)
        reader.join()
        engine.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "long_tokens": len(long_prompt), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
