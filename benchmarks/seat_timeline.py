"""Where our server's time goes with several clients at once: each of the worker's turns
logged (its passes' time, the replies decoding in them, the prompts being read and the
chunks read inside them, the requests waiting for a seat), and each request's prompt
tokens against those its caches already held.

    python benchmarks/seat_timeline.py [--model GGUF_OR_DIR] [--clients 8,16]
        [--workloads agent] [--max-tokens 160] [--requests 1]
        [--out benchmarks/results/seat-timeline.json] [-- server arguments, e.g. --draft none]

One server, the levels one after another on it (so a later level finds what an earlier one
left in the caches, as concurrency.py's levels do); the clients are concurrency.py's. Run
as ``seat_timeline.py --serve LOG [server arguments]`` it is that server: mlx_eagle.server
with the scheduler's turns written to LOG, one JSON line each.

Reported per level: tokens/s, p50 time to first token (chat), the worker's seconds in passes of replies alone, in passes
with prompts' chunks inside and in prompts' passes of their own, the passes' mean replies
and prompts being read (weighted by time), the prompt tokens read against those held, and
the five (replies decoding, prompts being read) states that took longest; in the JSON, each
packed pass's rows, drafted nodes verified and tokens committed.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent import add_model_argument, wait_ready  # noqa: E402 (the sibling scripts' servers and clients)
from concurrency import run_level  # noqa: E402
from levers import run_server  # noqa: E402

from mlx_eagle.blas import find_openblas  # noqa: E402
from mlx_eagle.models import resolve_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def serve(log_path: str, server_args: List[str]) -> None:
    """mlx_eagle.server with every turn's prompt reading and decoding pass, and every
    request's end, written to ``log_path``."""
    import mlx_eagle.scheduler as scheduler
    from mlx_eagle.scheduler import Scheduler, batched_round

    log = open(log_path, "a", buffering=1)
    read_prompts, decode, finish = Scheduler._read_prompts, Scheduler._decode, Scheduler._finish

    def logged(step, kind):
        def run(self) -> None:
            state = {"t": time.time(), "step": kind, "live": len(self.live), "waiting": len(self.waiting),
                     "rows": len(self._rows()), "reading": sum(r.reading is not None for r in self.live),
                     "chunks": [chunk.block.tokens.size for _, chunk in self.riding]}
            tic = time.perf_counter()
            try:
                step(self)
            finally:
                log.write(json.dumps({**state, "seconds": time.perf_counter() - tic}) + "\n")
        return run

    def finished(self, request) -> None:
        if request in self.live and request.generation is not None:
            log.write(json.dumps({"t": time.time(), "step": "end", "prompt": len(request.ids),
                                  "held": request.generation.decoder.reused}) + "\n")
        finish(self, request)

    def packed(decoders, rooms, reading=()):
        """scheduler.batched_round, each packed pass's rows, drafted nodes and tokens logged."""
        results = batched_round(decoders, rooms, reading)
        rounds = [result for result in results if not isinstance(result, Exception)]
        log.write(json.dumps({"t": time.time(), "step": "pass", "rows": len(decoders),
                              "drafted": sum(r.drafted for r in rounds), "tokens": sum(len(r.tokens) for r in rounds)})
                  + "\n")
        return results

    Scheduler._read_prompts, Scheduler._decode = logged(read_prompts, "read"), logged(decode, "decode")
    Scheduler._finish, scheduler.batched_round = finished, packed
    run_server(server_args)


def summarize(lines: List[dict], level: dict) -> dict:
    """One level's turns (``lines``) summed up."""
    seconds: Dict[str, float] = defaultdict(float)
    states: Dict[str, float] = defaultdict(float)
    rows = reading = 0.0
    for line in lines:
        if line["step"] == "decode" and line["rows"]:
            seconds["replies, chunks inside" if line["chunks"] else "replies alone"] += line["seconds"]
            states[f"{line['rows']} decoding, {line['reading']} reading"] += line["seconds"]
            rows += line["rows"] * line["seconds"]
            reading += line["reading"] * line["seconds"]
        elif line["step"] == "read":
            seconds["prompts alone"] += line["seconds"]
    ends = [line for line in lines if line["step"] == "end"]
    passes = seconds["replies alone"] + seconds["replies, chunks inside"]
    return {"clients": level["clients"], "wall_seconds": level["wall_seconds"], "tokens_per_s": level["tokens_per_s"],
            "p50_first_token": level["p50_first_token"],
            "seconds": dict(seconds), "mean_rows": rows / passes if passes else 0.0,
            "mean_reading": reading / passes if passes else 0.0,
            "prompt_tokens": sum(e["prompt"] for e in ends), "held_tokens": sum(e["held"] for e in ends),
            "requests": len(ends),
            "longest_states": sorted(states.items(), key=lambda kv: -kv[1])[:5],
            # each packed pass of rounds: [rows, drafted nodes verified, tokens committed]
            "passes": [[line["rows"], line["drafted"], line["tokens"]] for line in lines
                       if line["step"] == "pass" and line["rows"]]}


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        return serve(argv[1], argv[2:])
    ours, server_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_argument(parser)
    parser.add_argument("--clients", default="8,16", help="concurrency levels, comma-separated, one after another")
    parser.add_argument("--workloads", default="agent", choices=["agent", "chat"])
    parser.add_argument("--requests", type=int, default=1, help="chat prompts each client sends")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--port", type=int, default=8591)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "seat-timeline.json")
    args = parser.parse_args(ours)
    model_dir = resolve_model(args.model)
    env = dict(os.environ)
    if find_openblas():
        env["LD_PRELOAD"] = find_openblas()
    with tempfile.TemporaryDirectory() as scratch:
        log_path = Path(scratch) / "turns.jsonl"
        process = subprocess.Popen([sys.executable, __file__, "--serve", str(log_path), "--model", str(model_dir),
                                    "--port", str(args.port), "--quiet", *server_args],
                                   env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="local", max_retries=0,
                               timeout=3600)
        try:
            wait_ready(client, process)
            levels, skip = [], 0
            for clients in (int(c) for c in args.clients.split(",")):
                began = time.time()
                level = run_level(client, args.workloads, clients, args.requests, args.max_tokens, skip)
                skip += clients * args.requests
                lines = [json.loads(line) for line in log_path.read_text().splitlines()]
                levels.append(summarize([line for line in lines if line["t"] >= began], level))
                first = f", p50 first token {level['p50_first_token']:.2f} s" if level["p50_first_token"] else ""
                print(f"{clients:3} clients: {level['tokens_per_s']:5.1f} tokens/s{first}", file=sys.stderr, flush=True)
        finally:
            process.terminate()
            process.wait(timeout=60)
    result = {"model": str(model_dir), "workload": args.workloads, "max_tokens": args.max_tokens,
              "server_args": server_args, "levels": levels}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'clients':>7} {'tok/s':>6} {'wall s':>7} {'replies':>8} {'chunks in':>10} {'prompts':>8} "
          f"{'rows':>5} {'reading':>8} {'read/prompt tokens':>19}  longest states (s)")
    for level in levels:
        s = level["seconds"]
        states = ", ".join(f"{state}: {t:.1f}" for state, t in level["longest_states"][:3])
        print(f"{level['clients']:7} {level['tokens_per_s']:6.1f} {level['wall_seconds']:7.1f} "
              f"{s.get('replies alone', 0):8.1f} {s.get('replies, chunks inside', 0):10.1f} "
              f"{s.get('prompts alone', 0):8.1f} {level['mean_rows']:5.1f} {level['mean_reading']:8.1f} "
              f"{level['prompt_tokens'] - level['held_tokens']:>8}/{level['prompt_tokens']:<10}  {states}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
