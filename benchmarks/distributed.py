"""Ours against mlx-lm's own distributed generation, on a model sharded over local ranks,
with latency injected per collective to model real links between Macs.

    python benchmarks/distributed.py [--model M] [--ranks 3] [--latencies 0,1,5] [--prompts 2]
        [--prompts-file benchmarks/prompts/edit.jsonl] [--max-tokens 48] [--out benchmarks/results/distributed.json]

For each latency, one ``mlx.launch -n RANKS --backend ring`` run of this script's worker on
this machine's loopback. Every rank loads its shard with mlx_eagle.load (mlx-lm's
sharded_load underneath) and, prompt by prompt, alternating which goes first, decodes
greedily with mlx-lm's stream_generate (what mlx_lm.chat and mlx_lm.server run sharded) and
with mlx_eagle's default drafting. Latency: every all-sum and all-gather (two per layer
and forward pass, and one a round for our draft tree) first finishes the work before it,
then waits L ms, as a message crossing a link would; at 0 ms only the wait for the work
remains (both methods pay it; ours also gives up its compiled layer pieces, which cannot
pause mid-graph). Each latency times the target's forwards again in a cache
of its own, so drafts are sized on that link's costs.

Reported per latency: speedup over mlx-lm (whole replies, and decoding alone), τ, whether
the tokens are identical, and the cost model's prediction: τ divided by the cost of the
forward that verifies a round's tokens (the measured curve, in plain steps).
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parent.parent
LAUNCHER = Path(sys.executable).parent / "mlx.launch"


def inject_latency(milliseconds: float) -> None:
    """Every collective from now on waits for the work before it, then ``milliseconds``.
    (A compiled graph cannot pause: ours runs its layers' pieces uncompiled, a small cost on
    this CPU that only ours pays.)"""
    import mlx.core as mx

    from mlx_eagle import target

    target.COMPILED_TOKENS = 0

    def delayed(collective):
        def call(x, *args, **kwargs):
            mx.eval(x)
            time.sleep(milliseconds / 1000)
            return collective(x, *args, **kwargs)
        return call

    mx.distributed.all_sum = delayed(mx.distributed.all_sum)
    mx.distributed.all_gather = delayed(mx.distributed.all_gather)


def worker(args) -> None:
    import mlx.core as mx
    from mlx_lm import stream_generate as mlx_lm_stream_generate
    from mlx_lm.generate import generation_stream

    from mlx_eagle import load, stream_generate
    from mlx_eagle.costs import verify_costs
    from mlx_eagle.distributed import sharding, world
    from mlx_eagle.replies import chat_tokens

    model, tokenizer = load(args.model)
    inject_latency(args.latency)
    records = [json.loads(line) for line in args.prompts_file.read_text().splitlines()][:args.prompts]
    warm = chat_tokens(tokenizer, [{"role": "user", "content": records[0]["prompt"]}])
    list(mlx_lm_stream_generate(model, tokenizer, warm, max_tokens=4))  # untimed: this link's costs are timed
    mx.synchronize(generation_stream)
    list(stream_generate(model, tokenizer, warm, max_tokens=4, history=False))
    rows = []
    for index, record in enumerate(records):
        ids = chat_tokens(tokenizer, [{"role": "user", "content": record["prompt"]}])
        runs = {}
        for method in (["mlx_lm", "ours"] if index % 2 == 0 else ["ours", "mlx_lm"]):
            tic = time.perf_counter()
            if method == "mlx_lm":
                responses = list(mlx_lm_stream_generate(model, tokenizer, ids, max_tokens=args.max_tokens))
                mx.synchronize(generation_stream)  # its look-ahead step's collectives, before ours
            else:
                responses = list(stream_generate(model, tokenizer, ids, max_tokens=args.max_tokens))
            seconds = time.perf_counter() - tic
            last = responses[-1]
            runs[method] = {"tokens": [r.token for r in responses], "seconds": seconds,
                            "decode_tokens_per_s": last.generation_tps}
            if method == "ours":
                proposed = sum(stats.proposed for stats in last.sources.values())
                runs[method].update(tau=last.tokens_per_forward, rounds=last.target_forwards,
                                    proposed=proposed)
        rows.append({"id": record["id"], **runs})
    costs = verify_costs(model)
    ours = [row["ours"] for row in rows]
    tokens = sum(len(r["tokens"]) for r in ours)
    rounds = sum(r["rounds"] for r in ours)
    tau = tokens / rounds
    verified = 1 + sum(r["proposed"] for r in ours) / rounds  # tokens a verify pass reads, on average
    result = {
        "latency_ms": args.latency, "ranks": world().size(), "sharding": sharding(model),
        "speedup": sum(r["mlx_lm"]["seconds"] for r in rows) / sum(r["ours"]["seconds"] for r in rows),
        "decode_speedup": (sum(r["ours"]["decode_tokens_per_s"] for r in rows)
                           / sum(r["mlx_lm"]["decode_tokens_per_s"] for r in rows)),
        "tau": tau, "verified_per_round": verified, "predicted_speedup": tau / costs.at().steps(round(verified)),
        "identical": all(r["ours"]["tokens"] == r["mlx_lm"]["tokens"] for r in rows),
        "verify_ms": costs.verify_ms, "prompts": rows,
    }
    if world().rank() == 0:
        Path(args.worker_out).write_text(json.dumps(result))


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="as --model takes it (default: SmolLM2-135M-Instruct, split 3 ways)")
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--latencies", default="0,1,5", help="milliseconds added to every collective")
    parser.add_argument("--prompts", type=int, default=2, help="how many of the prompts to decode")
    parser.add_argument("--prompts-file", type=Path, default=ROOT / "benchmarks" / "prompts" / "edit.jsonl",
                        help="JSON lines with a 'prompt' each (default: the edit-style prompts)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "distributed.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--latency", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    from mlx_eagle.files import cache_dir

    rows = []
    for latency in [float(n) for n in args.latencies.split(",")]:
        with tempfile.TemporaryDirectory() as scratch:
            cache = Path(scratch) / "cache"  # this link's timings, the user's converted models
            cache.mkdir()
            if (cache_dir() / "models").exists():
                (cache / "models").symlink_to(cache_dir() / "models")
            out = Path(scratch) / "result.json"
            command = [str(LAUNCHER), "-n", str(args.ranks), "--backend", "ring", "--starting-port",
                       str(random.randrange(20000, 60000, 16)), "--", sys.executable, __file__, "--worker",
                       "--latency", str(latency), "--prompts", str(args.prompts), "--prompts-file",
                       str(args.prompts_file.resolve()), "--max-tokens",
                       str(args.max_tokens), "--worker-out", str(out)] + (["--model", args.model] if args.model else [])
            print(f"{latency:g} ms a collective: {' '.join(command[command.index('--') + 1:])}", file=sys.stderr,
                  flush=True)
            run = subprocess.run(command, cwd=ROOT, env={**os.environ, "MLX_EAGLE_CACHE": str(cache)},
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if run.returncode != 0 or not out.exists():
                sys.exit(f"error: the run at {latency:g} ms failed:\n{run.stderr[-2000:]}")
            rows.append(json.loads(out.read_text()))
        print(line(rows[-1]), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)  # after every latency: a long run stopped keeps them
        args.out.write_text(json.dumps({"model": args.model or "SmolLM2-135M-Instruct", "ranks": args.ranks,
                                        "max_tokens": args.max_tokens, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


def line(row: dict) -> str:
    return (f"| {row['latency_ms']:g} ms | **{row['speedup']:.2f}×** | {row['decode_speedup']:.2f}× | "
            f"{row['tau']:.2f} | {row['predicted_speedup']:.2f}× | {row['identical']} |")


if __name__ == "__main__":
    main()
