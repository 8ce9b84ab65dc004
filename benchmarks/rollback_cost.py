"""What rolling back a hybrid model's recurrent state costs, per family (rewind.py).

    python benchmarks/rollback_cost.py [--repeats 21] [--out benchmarks/results/rollback-cost.json]

Two ways, both timed here for chains of 1, 4, 8 and 16 whose first half is accepted (so
the root and half the chain are kept), next to one plain step (a forward over one token),
on the tiny models of every family (tests/hybrids.py) and on a random-weight Qwen3.5 of
about 1B parameters (width 1536, 28 layers, as Qwen3.5-0.8B/2B are shaped):

- replay (what the decoder does, but for Mamba 2 layers): the verify pass is recorded, and the kept states are
  the conv inputs sliced and the recurrences run again over the kept steps. It costs the
  recording's overhead on the pass plus the replay: a recorded pass and its rollback,
  against the same pass unrecorded.
- re-read (for Mamba 2 layers, and recurrent layers rewind.py does not know): restore a snapshot
  and read the kept tokens again in front of the next chain. It costs the snapshot and
  the kept tokens' share of the next pass: a forward over (kept + next chain) tokens
  against one over the next chain alone.
"""

import argparse
import importlib
import json
import statistics
import sys
import time
from contextlib import nullcontext
from typing import List, Optional
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


def paired(first, second, repeats: int) -> float:
    """Median ms of ``first`` less ``second``, run alternately so that drift hits both alike."""
    first(), second()  # warm-up
    differences = []
    for _ in range(repeats):
        tic = time.perf_counter()
        first()
        middle = time.perf_counter()
        second()
        differences.append(1000 * ((middle - tic) - (time.perf_counter() - middle)))
    return max(statistics.median(differences), 0.0)


def costs(model, vocab: int, repeats: int, context: int = 64) -> dict:
    cache = make_prompt_cache(model)
    mx.eval(model(mx.arange(context)[None] % vocab, cache=cache))
    rewind, replays = Rewind(model, cache, replay=True), Rewind(model, cache).replays
    start = rewind.snapshot()

    def state():
        return [c.state for c in cache]

    def forward(count: int):
        def run():
            mx.eval(model(mx.arange(count)[None] % vocab, cache=cache), state())
            rewind.restore(start)
        return run

    def then_next(count: int, kept: Optional[int]):
        """A pass over ``count`` tokens, recorded and cut back to ``kept`` (None: neither),
        then the next pass over as many: the replayed states are computed with it."""
        def run():
            with rewind.recording() if kept else nullcontext() as recorded:
                model(mx.arange(count)[None] % vocab, cache=cache)
            assert kept is None or rewind.cut_back(start, recorded, kept)
            mx.eval(model(mx.arange(count)[None] % vocab, cache=cache), state())
            rewind.restore(start)
        return run

    plain = timed(forward(1), repeats)
    row = {"plain_step_ms": plain, "decoder_rolls_back_by": "replay" if replays else "re-read"}
    for chain in CHAINS:
        kept = chain // 2 + 1  # the root and the accepted half
        replay = paired(then_next(chain + 1, kept), then_next(chain + 1, None), repeats)
        snapshot_ms = timed(lambda: rewind.restore(rewind.snapshot()), repeats)
        reread = snapshot_ms + paired(forward(chain + 1 + kept), forward(chain + 1), repeats)
        row[f"chain {chain}"] = {"kept_tokens": kept, "replay_ms": replay,
                                 "replay_of_a_plain_step": replay / plain,
                                 "reread_ms": reread, "reread_of_a_plain_step": reread / plain}
    return row


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--families", nargs="*", help="only these (default: all, and the 1B Qwen3.5)")
    parser.add_argument("--no-1b", action="store_true", help="leave out the 1B-scale Qwen3.5")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "rollback-cost.json")
    args = parser.parse_args(argv)
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
    print(f"{'family':32} {'plain ms':>9} " + " ".join(f"{'chain ' + str(c):>22}" for c in CHAINS))
    print(f"{'':32} {'':>9} " + " ".join(f"{'replay / re-read':>22}" for c in CHAINS))
    for family, row in results.items():
        cells = [f"{cell['replay_of_a_plain_step']:5.1%} / {cell['reread_of_a_plain_step']:5.1%}"
                 for cell in (row[f"chain {c}"] for c in CHAINS)]
        print(f"{family:32} {row['plain_step_ms']:9.2f} " + " ".join(f"{cell:>22}" for cell in cells)
              + f"  {row['decoder_rolls_back_by']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
