"""What a mixture of experts does to the verify-cost curve.

A synthetic Qwen3-MoE-shaped target (random weights: 8 layers, width 512, 64 experts of
width 256, 4 per token) against a dense twin with the same active width (one MLP of
4 x 256): the time of one verification over k new tokens after 256 cached, as the
runtime measures it for its cost model (``costs.time_forwards``: k distinct
tokens) and, for contrast, over k copies of one token; and how many distinct experts
a layer runs for k tokens. A dense layer reads its weights once for any k; an MoE layer
reads every expert some token picked, so its curve climbs with k until all experts are
touched: trees pay more on MoE targets, and calibration must time distinct tokens to
see it.

    python benchmarks/moe_verify_cost.py [--layers 8] [--out benchmarks/results/moe-verify-cost.json]
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_map
import numpy as np
from typing import List, Optional
from mlx_lm.models import switch_layers

from mlx_eagle.costs import CALIBRATION_SIZES, time_forwards
from mlx_eagle.cli import use_fast_blas
from mlx_eagle.architectures import model_classes
from mlx_eagle.target import make_cache, target_forward

SHAPE = {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
         "head_dim": 64, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "vocab_size": 32000, "max_position_embeddings": 4096,
         "tie_word_embeddings": True}
MOE = dict(SHAPE, model_type="qwen3_moe", intermediate_size=1024, num_experts=64, num_experts_per_tok=4,
           decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=256, norm_topk_prob=True)
DENSE = dict(SHAPE, model_type="qwen3", intermediate_size=4 * 256)  # the same active width per token


def build(config: dict):
    model_class, args_class = model_classes(config["model_type"])
    model = model_class(args_class.from_dict(config))
    mx.random.seed(0)
    model.update(tree_map(lambda p: 0.05 * mx.random.normal(p.shape), model.parameters()))
    mx.eval(model.parameters())
    return model


def repeated_token_costs(model, context: int = 256, repeats: int = 3) -> dict:
    """As costs.time_forwards, but the k new tokens are one token repeated."""
    rng = np.random.default_rng(0)
    cache = make_cache(model)
    mx.eval(target_forward(model, mx.array([rng.integers(100, 30000, context).tolist()]), cache, 0, "causal").logits)
    result = {}
    for size in CALIBRATION_SIZES:
        times = []
        for _ in range(repeats + 1):
            tic = time.perf_counter()
            mask = "causal" if size > 1 else None
            mx.eval(target_forward(model, mx.full((1, size), 1234), cache, context, mask).logits)
            times.append(1000 * (time.perf_counter() - tic))
            for layer_cache in cache:
                layer_cache.trim(size)
        result[size] = statistics.median(times[1:])
    return result


def experts_touched(model, sizes=CALIBRATION_SIZES) -> dict:
    """Mean distinct experts a layer runs for k distinct tokens (eager forward, recorded)."""
    seen = []
    original = switch_layers.SwitchGLU.__call__

    def recording(self, x, indices):
        seen.append(len(np.unique(np.array(indices))))
        return original(self, x, indices)

    switch_layers.SwitchGLU.__call__ = recording
    try:
        result = {}
        rng = np.random.default_rng(1)
        for size in sizes:
            seen.clear()
            mx.eval(model(mx.array([rng.integers(100, 30000, size).tolist()])))
            result[size] = float(np.mean(seen))
        return result
    finally:
        switch_layers.SwitchGLU.__call__ = original


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"], help="of both models")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "moe-verify-cost.json")
    args = parser.parse_args(argv)
    use_fast_blas()
    moe, dense = build(dict(MOE, num_hidden_layers=args.layers)), build(dict(DENSE, num_hidden_layers=args.layers))
    curves = {
        "dense, distinct tokens": time_forwards(dense, repeats=3),
        "MoE, distinct tokens (what calibration times)": time_forwards(moe, repeats=3),
        "MoE, one token repeated": repeated_token_costs(moe),
    }
    touched = experts_touched(moe)
    print(f"{'k':>4} " + " ".join(f"{name[:28]:>30}" for name in curves) + f" {'experts/layer':>14}")
    for size in CALIBRATION_SIZES:
        cells = [f"{curve[size]:8.1f} ms ({curve[size] / curve[1]:4.2f}x)" for curve in curves.values()]
        print(f"{size:>4} " + " ".join(f"{cell:>30}" for cell in cells) + f" {touched[size]:>14.1f}")
    args.out.write_text(json.dumps({"shape": {"moe": MOE, "dense": DENSE}, "verify_ms": curves,
                                    "experts_per_layer": touched}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
