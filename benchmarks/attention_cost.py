"""What a verified block's attention costs at long contexts on this device, and where it goes.

One layer's attention at Qwen2.5-Coder-0.5B's shape (14 query heads, 2 KV heads, head size
64), over contexts of 512 to 32k cached entries: for one new row (a plain decoding step)
and for a block of new rows (a verified draft, under a tree mask), the whole
``mx.fast.scaled_dot_product_attention`` and, apart, its pieces: the two matrix products
and the exponentials of the scores; and the whole attention again over an 8-bit cache, as
mlx-lm's quantized KV caches attend (``--kv-bits 8``). A block of k rows does k times the arithmetic of one
row but reads the cache once, so where reading dominates (Apple GPUs) it costs about one
row; where the per-element work dominates, it costs about k rows, and a verified block
grows dear as the context grows (``benchmarks/long_context.py``).

    python benchmarks/attention_cost.py [--contexts 512,2048,8192,16384,32768] [--rows 16]
        [--out benchmarks/results/attention-cost.json]
"""

import argparse
import json
from pathlib import Path
from typing import Callable, Dict, List, Optional

import mlx.core as mx
from mlx_lm.models.base import quantized_scaled_dot_product_attention

from mlx_eagle import costs
from mlx_eagle.bench import machine
from mlx_eagle.cli import use_fast_blas

HEADS, KV_HEADS, HEAD_SIZE = 14, 2, 64  # Qwen2.5-Coder-0.5B's attention


def median_ms(make: Callable[[], mx.array], repeats: int = 7) -> float:
    """Median milliseconds of evaluating what ``make`` builds (costs.median_ms, after a warm-up)."""
    return costs.median_ms(lambda: mx.eval(make()), repeats)


def layer_times(context: int, rows: int) -> Dict[str, float]:
    """Milliseconds of one layer's attention for ``rows`` new rows after ``context`` cached
    entries, whole and by piece (the pieces as MLX's CPU path computes them, grouped by KV head)."""
    keys = mx.random.normal((1, KV_HEADS, context + rows, HEAD_SIZE))
    values = mx.random.normal((1, KV_HEADS, context + rows, HEAD_SIZE))
    queries = mx.random.normal((1, HEADS, rows, HEAD_SIZE))
    mask = mx.concatenate([mx.ones((rows, context), dtype=mx.bool_),
                           mx.tril(mx.ones((rows, rows), dtype=mx.bool_))], axis=1)  # a chain: the costliest tree
    grouped = queries.reshape(1, KV_HEADS, HEADS // KV_HEADS * rows, HEAD_SIZE)
    packed_keys, packed_values = mx.quantize(keys, group_size=64, bits=8), mx.quantize(values, group_size=64, bits=8)
    scores = grouped @ keys.swapaxes(-1, -2)
    weights = mx.softmax(scores, axis=-1)
    mx.eval(keys, values, queries, mask, scores, weights, packed_keys, packed_values)
    return {
        "attention": median_ms(lambda: mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=HEAD_SIZE ** -0.5, mask=mask if rows > 1 else None)),
        "scores_matmul": median_ms(lambda: grouped @ keys.swapaxes(-1, -2)),
        "exp": median_ms(lambda: mx.exp(scores)),
        "values_matmul": median_ms(lambda: weights @ values),
        "attention_8bit_cache": median_ms(lambda: quantized_scaled_dot_product_attention(
            queries * 1, packed_keys, packed_values, scale=HEAD_SIZE ** -0.5, mask=mask if rows > 1 else None),
            repeats=3),  # (queries * 1: it scales its queries in place)
    }


def element_ns() -> Dict[str, float]:
    """Nanoseconds per element of an exponential and of a multiplication, over 4M floats."""
    x = mx.random.normal((1 << 22,))
    mx.eval(x)
    return {"exp": median_ms(lambda: mx.exp(x)) * 1e6 / x.size, "multiply": median_ms(lambda: x * x) * 1e6 / x.size}


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="512,2048,8192,16384,32768")
    parser.add_argument("--rows", type=int, default=16, help="the verified block's rows")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "attention-cost.json")
    args = parser.parse_args(argv)
    use_fast_blas()
    per_element = element_ns()
    print(f"per element: exp {per_element['exp']:.2f} ns, multiply {per_element['multiply']:.2f} ns")
    print(f"{'context':>8} {'1 row ms':>9} {f'{args.rows} rows ms':>11} {'ratio':>6} "
          f"{'of which: scores':>17} {'exp':>7} {'values':>7} {'8-bit cache: 1 row':>19} {'block':>7}")
    rows = []
    for context in [int(n) for n in args.contexts.split(",")]:
        one, block = layer_times(context, 1), layer_times(context, args.rows)
        rows.append({"context": context, "one_row_ms": one, "block_ms": block,
                     "block_over_one_row": block["attention"] / one["attention"]})
        print(f"{context:>8} {one['attention']:>9.2f} {block['attention']:>11.2f} "
              f"{block['attention'] / one['attention']:>5.1f}x {block['scores_matmul']:>17.2f} "
              f"{block['exp']:>7.2f} {block['values_matmul']:>7.2f} {one['attention_8bit_cache']:>19.2f} "
              f"{block['attention_8bit_cache']:>7.2f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_size": HEAD_SIZE}, "block_rows": args.rows,
        "per_element_ns": per_element, "rows": rows, "machine": machine()}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
