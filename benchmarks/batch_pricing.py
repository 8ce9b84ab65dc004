"""The batch layout and its pricing: a packed pass (target.packed_forward: every row's new
token through the dense layers together, each row's attention over its own cache) timed
against mlx-lm's own batched forward over ``BatchKVCache``, for each number of rows; then
what the cost model makes of drafts in a batch whose rows' drafts are accepted at
different rates (``--acceptance``, one per row in turn), on this device's costs (its
one-row curve and its packed passes by shape, as the runtime times them: Costs.pass_ms)
and on an Apple-GPU-like curve (a 16-token block costs about one step, then linear; rows
priced as tokens), as throughput against plain batching of the same rows:
- "across rows", as batched_round chooses: each row drafts up to its cap (priced beside the
  others' roots), then the (row, node) pairs with the most expected tokens per unit of the
  whole pass's cost are kept (node_odds.choose_across);
- "in seat order", the rule it replaced (before b71b2a1): rows priced in turn, each beside
  the drafts of the rows before it and the roots of those after.

    python benchmarks/batch_pricing.py [--model GGUF_OR_DIR] [--rows 1,2,4,8,16,32]
        [--context 300] [--acceptance 0.8,0.3] [--out benchmarks/results/batch-pricing.json]
"""

import argparse
import json
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from mlx_eagle.cli import use_fast_blas

ROOT = Path(__file__).resolve().parent.parent
GPU_LIKE = {1: 10.0, 16: 10.5, 32: 20.0, 64: 40.0, 128: 80.0}  # milliseconds: flat to 16 tokens, then linear
MAX_DRAFT = 8


def time_passes(model, rows: int, context: int, repeats: int) -> Dict[str, float]:
    """Milliseconds of one new token for each of ``rows`` rows: packed, and mlx-lm batched."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    from mlx_eagle.target import Block, make_cache, packed_forward

    caches = []
    for _ in range(rows):
        cache = make_cache(model)
        model(mx.array([[5] * context]), cache=cache)
        mx.eval([layer.state for layer in cache])
        caches.append(cache)
    batched = [BatchKVCache([0] * rows) for _ in model.layers]
    model(mx.array([[5] * context] * rows), cache=batched)
    mx.eval([layer.state for layer in batched])

    def packed() -> None:
        outs = packed_forward(model, [Block(mx.array([7], dtype=mx.int32), cache, cache[0].offset, None, None)
                                      for cache in caches])
        mx.eval([out.logits for out in outs])
        for cache in caches:
            for layer in cache:
                layer.trim(1)

    def mlx_lm() -> None:
        mx.eval(model(mx.array([[7]] * rows), cache=batched))
        for layer in batched:
            layer.trim(1)

    timed = {}
    for name, step in (("packed", packed), ("mlx_lm", mlx_lm)):
        step()
        tic = time.perf_counter()
        for _ in range(repeats):
            step()
        timed[name] = 1000 * (time.perf_counter() - tic) / repeats
    return timed


def priced(costs, rows: int, acceptances: List[float]) -> Dict[str, Dict[str, float]]:
    """Nodes per row and throughput against plain batching of the same rows, for drafts
    chosen across rows and in seat order; row r's drafts each accepted with
    ``acceptances[r % len(acceptances)]`` once the ones before it were."""
    from mlx_eagle.drafters import Budget
    from mlx_eagle.drafters.lookup import LookupDraft, LookupDrafter
    from mlx_eagle.node_odds import choose_across

    rates = [acceptances[row % len(acceptances)] for row in range(rows)]
    rng = np.random.default_rng(0)
    drafters = {}
    for rate in set(rates):  # a drafter whose record shows its rate
        drafters[rate] = LookupDrafter(costs.at())
        for _ in range(400):
            accepted = 0
            while accepted < MAX_DRAFT and rng.random() < rate:
                accepted += 1
            drafters[rate].record(LookupDraft(list(range(MAX_DRAFT)), kind=1), accepted=accepted)

    def length(rate: float, beside: Tuple[int, int]) -> int:
        drafter = drafters[rate]
        drafter.price(Budget(room=MAX_DRAFT, nodes=MAX_DRAFT, pricing=costs.at(beside=beside)))
        return drafter.best_length(1, MAX_DRAFT, verified=1, expected=1.0)

    def outcome(sizes: List[int]) -> Dict[str, float]:
        tokens = sum(1 + sum(rate ** j for j in range(1, n + 1)) for rate, n in zip(rates, sizes))
        plain = rows / costs.pass_ms(rows, rows)
        return {"nodes_per_row": sum(sizes) / rows,
                "vs_plain_batching": tokens / costs.pass_ms(rows, rows + sum(sizes)) / plain}

    in_turn: List[int] = []
    for row, rate in enumerate(rates):
        in_turn.append(length(rate, (sum(1 + n for n in in_turn) + rows - row - 1, rows)))
    caps = [length(rate, (rows - 1, rows)) for rate in rates]
    kept = choose_across([[rate ** j for j in range(1, cap + 1)] for rate, cap in zip(rates, caps)], rows,
                         lambda tokens: costs.pass_ms(rows, tokens))
    return {"across rows": outcome([len(nodes) for nodes in kept]), "in seat order": outcome(in_turn)}


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(Path.home() / ".cache/mlx-eagle/gguf/"
                                              "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
                        help="a GGUF or model directory (default: Qwen2.5-Coder-0.5B-Instruct)")
    parser.add_argument("--rows", default="1,2,4,8,16,32")
    parser.add_argument("--context", type=int, default=300, help="tokens cached per row")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--acceptance", default="0.8,0.3",
                        help="each row's chance that a draft is accepted, one per row in turn, comma-separated")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "batch-pricing.json")
    args = parser.parse_args(argv)
    use_fast_blas()
    from mlx_eagle import load
    from mlx_eagle.costs import Costs, time_forwards, time_packed_passes

    model, _ = load(args.model)
    rows = [int(r) for r in args.rows.split(",")]
    acceptances = [float(a) for a in args.acceptance.split(",")]
    passes = {r: time_passes(model, r, args.context, args.repeats) for r in rows}
    here = Costs(time_forwards(model, context=args.context), packed_ms=time_packed_passes(model, context=args.context))
    result = {"model": args.model, "context": args.context, "acceptance": acceptances, "passes_ms": passes,
              "costs_ms": {"verify": here.verify_ms, "packed": here.packed_ms},
              "priced": {"this device": {r: priced(here, r, acceptances) for r in rows},
                         "apple-gpu-like": {r: priced(Costs(GPU_LIKE), r, acceptances) for r in rows}}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    rules = ("across rows", "in seat order")
    print(f"{'':26}" + "".join(f"{curve + ': nodes/row, vs plain':>48}" for curve in result["priced"]))
    print(f"{'rows':>4} {'packed ms':>10} {'mlx-lm ms':>10}" + "".join(f"{rule:>24}" for _ in result["priced"]
                                                                     for rule in rules))
    for r in rows:
        cells = [result["priced"][curve][r][rule] for curve in result["priced"] for rule in rules]
        print(f"{r:4} {passes[r]['packed']:10.0f} {passes[r]['mlx_lm']:10.0f}" + "".join(
            f"{cell['nodes_per_row']:15.1f} {cell['vs_plain_batching']:7.2f}x" for cell in cells))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
