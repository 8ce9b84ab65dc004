"""What rolling back a hybrid model's recurrent state costs, per family (rewind.py).

    python benchmarks/rollback_cost.py [--repeats 5] [--out benchmarks/results/rollback-cost.json]

A round that rejects part of its chain restores the caches from a snapshot and reads the
accepted tokens again in front of the next round's chain. So a rollback costs (1) taking
and restoring the snapshot, and (2) the replayed tokens' share of the next forward pass:
a forward over (replayed + next chain) tokens against one over the next chain alone. Both
are timed here for chains of 1, 4, 8 and 16 whose first half is accepted (so half the
chain plus the root is replayed), next to one plain step (a forward over one token), on
the tiny models of every family (tests/hybrids.py) and on a random-weight Qwen3.5 of about
1B parameters (width 1536, 28 layers, as Qwen3.5-0.8B/2B are shaped).
"""

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlx_eagle.cli import use_fast_blas
from mlx_eagle.rewind import Rewind

HERE = Path(__file__).resolve().parent
CHAINS = (1, 4, 8, 16)
ONE_B = {"model_type": "qwen3_5", "text_config": {
    "model_type": "qwen3_5_text", "hidden_size": 1536, "intermediate_size": 4608, "num_hidden_layers": 28,
    "num_attention_heads": 12, "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 151936,
    "linear_num_value_heads": 16, "linear_num_key_heads": 16, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
    "max_position_embeddings": 4096, "tie_word_embeddings": True}}


def timed(run, repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        run()
        times.append(1000 * (time.perf_counter() - tic))
    return statistics.median(times)


def costs(model, vocab: int, repeats: int, context: int = 64) -> dict:
    cache = make_prompt_cache(model)
    mx.eval(model(mx.arange(context)[None] % vocab, cache=cache))
    rewind = Rewind(cache)
    start = rewind.snapshot()

    def forward(count: int):
        def run():
            mx.eval(model(mx.arange(count)[None] % vocab, cache=cache))
            rewind.restore(start)
        return run

    plain = timed(forward(1), repeats)
    row = {"plain_step_ms": plain}
    for chain in CHAINS:
        replayed = chain // 2 + 1  # the root and the accepted half
        snapshot_ms = timed(lambda: rewind.restore(rewind.snapshot()), repeats)
        with_replay, without = forward(chain + 1 + replayed), forward(chain + 1)
        with_replay(), without()  # warm-up
        differences = []
        for _ in range(repeats):  # alternating, so that drift hits both alike
            tic = time.perf_counter()
            with_replay()
            middle = time.perf_counter()
            without()
            differences.append(1000 * ((middle - tic) - (time.perf_counter() - middle)))
        marginal = statistics.median(differences)
        total = snapshot_ms + max(marginal, 0.0)
        row[f"chain {chain}"] = {"replayed_tokens": replayed, "snapshot_and_restore_ms": snapshot_ms,
                                 "replay_ms": marginal, "rollback_ms": total, "of_a_plain_step": total / plain}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--families", nargs="*", help="only these (default: all, and the 1B Qwen3.5)")
    parser.add_argument("--no-1b", action="store_true", help="leave out the 1B-scale Qwen3.5")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "rollback-cost.json")
    args = parser.parse_args()
    use_fast_blas()
    sys.path.insert(0, str(HERE.parent / "tests"))
    import hybrids

    results = {}
    for family in args.families or list(hybrids.FAMILIES):
        results[family] = costs(hybrids.build(family), hybrids.VOCAB, args.repeats)
    if not args.no_1b:
        module = importlib.import_module("mlx_lm.models.qwen3_5")
        model = module.Model(module.ModelArgs.from_dict(ONE_B))
        mx.eval(model.parameters())
        results["qwen3_5 ~1B (random weights)"] = costs(model, 151936, min(args.repeats, 7))
    print(f"{'family':32} {'plain ms':>9} " + " ".join(f"{'chain ' + str(c):>16}" for c in CHAINS))
    for family, row in results.items():
        cells = [f"{row[f'chain {c}']['rollback_ms']:6.2f} ({row[f'chain {c}']['of_a_plain_step']:4.0%})"
                 for c in CHAINS]
        print(f"{family:32} {row['plain_step_ms']:9.2f} " + " ".join(f"{cell:>16}" for cell in cells))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
