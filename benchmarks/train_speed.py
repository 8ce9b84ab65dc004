"""How fast the head trainer runs here, and what fraction of this machine's matmul rate it uses.

The recipe PLATFORM.md timed on the trainer of commit 985e530 (3.4 s a step): EAGLE-3,
SmolLM2-135M-Instruct in float32 as the target, 4 sequences of 400 tokens a step,
training-time test unrolled 3 times, a draft vocabulary of 8,192. The same step through
today's Trainer, compiled and eager, recomputing the target's states for every batch, and
compiled reading them from a --store-features store (as the 985e530 trainer read stored
features); medians of --steps steps after two warm-ups, and the target's forward alone.
Floating-point work is counted analytically (matmuls and attention, forward of the target,
forward and backward of the head: backward = 2 x forward) and divided by the step time;
the machine's rate is a 2048 x 2048 float32 matmul timed in the same run.

    python benchmarks/train_speed.py [--steps 5] [--out benchmarks/results/train-speed.json]
    python benchmarks/train_speed.py --rows 1 --length 2048 --ttt 5 --modes compiled \
        --out benchmarks/results/train-speed-2048-ttt5.json
"""

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from typing import List, Optional

from mlx_eagle.cli import use_fast_blas
from mlx_eagle.models import load_target
from mlx_eagle.target import default_taps
from mlx_eagle.train import StateStore, Trainer, TrainConfig, drafter_to_train, make_batch, target_states

BEFORE_S = 3.4  # PLATFORM.md: one step of this recipe on the trainer of commit 985e530, this machine class


def matmul_rate(size: int = 2048, repeats: int = 10) -> float:
    """GFLOP/s of a float32 size x size matmul here (best of ``repeats``)."""
    a, b = mx.random.normal((size, size)), mx.random.normal((size, size))
    mx.eval(a @ b)
    best = float("inf")
    for _ in range(repeats):
        tic = time.perf_counter()
        mx.eval(a @ b)
        best = min(best, time.perf_counter() - tic)
    return 2 * size ** 3 / best / 1e9


def step_flops(args, rows: int, length: int, ttt: int, draft_vocab: int) -> float:
    """Matmul and attention FLOPs of one training step (see the module docstring)."""
    hidden, heads, kv_heads = args.hidden_size, args.num_attention_heads, args.num_key_value_heads
    head_dim = hidden // heads
    tokens = rows * length

    def layer(width_in: int, context: int) -> float:  # one decoder layer over `tokens` tokens
        projections = 2 * tokens * width_in * head_dim * (heads + 2 * kv_heads) + 2 * tokens * hidden * hidden
        mlp = 2 * tokens * 3 * hidden * args.intermediate_size
        attention = 2 * 2 * tokens * context * heads * head_dim
        return projections + mlp + attention

    target = args.num_hidden_layers * layer(hidden, length / 2)
    labels = 2 * tokens * hidden * draft_vocab  # the target's probabilities over the draft vocabulary
    head_forward = 2 * tokens * 3 * hidden * hidden + sum(
        layer(2 * hidden, length / 2 + step) + 2 * tokens * hidden * draft_vocab for step in range(ttt))
    return target + labels + 3 * head_forward


def time_steps(target, pieces, used, mode, steps, work, ttt) -> float:
    """Median seconds of a training step: ``mode`` compiled, eager, or stored (compiled,
    reading the target's states from a --store-features store, as 985e530 read features)."""
    rows, length = len(pieces), len(pieces[0][0])
    config = TrainConfig(steps=10_000, tokens_per_batch=rows * length, ttt_steps=ttt, seq_len=length,
                         pad_multiple=16, compile=mode != "eager", checkpoint_every=10_000)
    store = None
    if mode == "stored":
        store = StateStore(work / "store", target, pieces, default_taps(target.args.num_hidden_layers), length)
        store.fill(rows * length, progress=False)
    trainer = Trainer(target, drafter_to_train(target, config, used), pieces, config, work, used, progress=False,
                      store=store)
    times = []
    for _ in range(steps + 2):
        tic = time.perf_counter()
        trainer.train_step()
        trainer.step += 1
        times.append(time.perf_counter() - tic)
    return statistics.median(times[2:])


def time_target(target, pieces, steps) -> float:
    """The target's forward over one batch, as a training step computes it."""
    tokens = make_batch(pieces)["tokens"]
    taps = default_taps(target.args.num_hidden_layers)
    times = []
    for _ in range(steps + 2):
        tic = time.perf_counter()
        mx.eval(*target_states(target, tokens, taps))
        times.append(time.perf_counter() - tic)
    return statistics.median(times[2:])


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--length", type=int, default=400)
    parser.add_argument("--ttt", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["compiled", "eager", "stored"],
                        choices=["compiled", "eager", "stored"])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "train-speed.json")
    args = parser.parse_args(argv)
    ROWS, LENGTH, TTT = args.rows, args.length, args.ttt  # noqa: N806
    use_fast_blas()
    target, _, _ = load_target(None, progress=False)
    rng = np.random.default_rng(0)
    vocab = target.args.vocab_size
    used = np.sort(rng.choice(vocab, 8192, replace=False))
    rate = matmul_rate()
    print(f"float32 matmul here: {rate:.0f} GFLOP/s; taps {default_taps(target.args.num_hidden_layers)}")
    pieces = [(rng.integers(100, vocab - 100, LENGTH).astype(np.int32), np.ones(LENGTH, bool))
              for _ in range(ROWS)]
    flops = step_flops(target.args, ROWS, LENGTH, TTT, len(used))
    no_target = step_flops(dataclasses.replace(target.args, num_hidden_layers=0), ROWS, LENGTH, TTT, len(used))
    with tempfile.TemporaryDirectory() as work:
        timed = {mode: time_steps(target, pieces, used, mode, args.steps, Path(work) / mode, TTT)
                 for mode in args.modes}
    target_s = time_target(target, pieces, args.steps)
    results = {"matmul_gflops": rate,
               "recipe": {"rows": ROWS, "length": LENGTH, "ttt_steps": TTT, "draft_vocab": 8192},
               "gflop_per_step": flops / 1e9, "target_gflop_per_step": (flops - no_target) / 1e9,
               "target_forward_s": target_s}
    before = BEFORE_S if (ROWS, LENGTH, TTT) == (4, 400, 3) else None  # 985e530 was timed on this recipe only
    if before:
        results["before_985e530_s"] = before
    for mode, seconds in timed.items():
        work = no_target if mode == "stored" else flops  # a stored step does not run the target
        head_s = seconds if mode == "stored" else seconds - target_s
        results[mode] = {"s_per_step": seconds, "tokens_per_s": ROWS * LENGTH / seconds,
                         "gflops": work / seconds / 1e9,
                         "fraction_of_matmul_rate": work / seconds / 1e9 / rate, "head_only_s": head_s}
        line = (f"{mode}: {seconds:.2f} s/step, {ROWS * LENGTH / seconds:.0f} tokens/s, {work / seconds / 1e9:.0f} "
                f"GFLOP/s ({work / seconds / 1e9 / rate:.0%} of the matmul rate); the head's part {head_s:.2f} s")
        if before:
            results[mode].update(speedup_vs_985e530=before / seconds, head_only_speedup_vs_985e530=before / head_s)
            line += f"; vs the 985e530 trainer's {before} s: {before / seconds:.2f}x (head only {before / head_s:.2f}x)"
        print(line)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
