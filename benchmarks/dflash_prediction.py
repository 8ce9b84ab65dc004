"""What the cost model predicts for DFlash drafters on an Apple-GPU-like verify curve and on
this CPU's measured one, next to what peers measured on Macs. A prediction, not a
measurement: no Apple GPU runs here.

    python benchmarks/dflash_prediction.py [--out benchmarks/results/dflash-prediction.json]

For each drafter, acceptance by block position is taken as one rate r at every position,
chosen so that a chain of block - 1 drafts yields the published tau (1 + r + ... + r^15);
the drafter sizes its chain as it does while decoding (ChainDrafter.best_length on the
curve, the measured rates), and a round costs a verify pass over 1 + L tokens plus one
drafter pass (its layers over the block, as a share of the target's). Predicted speedup =
tokens per round / round cost, in plain decoding steps.
"""

import argparse
import json
from pathlib import Path

import numpy as np

from mlx_eagle.drafters.chains import ChainDrafter

HERE = Path(__file__).resolve().parent
BLOCK = 16

# (drafter, published tau at temperature 0 on a chain of 15, drafter layers / target layers,
#  what a peer measured on a Mac, and where it is from: ../shared/DRAFTERS.md)
DRAFTERS = [
    ("z-lab Qwen3-8B-DFlash-b16, MT-bench", 4.24, 5 / 36, None, "arXiv 2602.06036"),
    ("z-lab Qwen3-8B-DFlash-b16, GSM8K", 6.54, 5 / 36, None, "arXiv 2602.06036"),
    ("Qwen3.5-9B DFlash, MT-bench", 5.5, 5 / 32, "4.37x (dflash-mlx, M5 Max)", "bstnxbt/dflash-mlx README"),
]

CURVES = {  # a forward over k new tokens, in plain steps
    "Apple GPU (flat: 16 tokens ~ 1.3 steps)": lambda k: 1.0 + 0.02 * (k - 1),
}


def rate_for(tau: float, drafts: int = BLOCK - 1) -> float:
    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        if 1 + sum(middle ** i for i in range(1, drafts + 1)) < tau:
            low = middle
        else:
            high = middle
    return low


def predict(tau: float, draft_share: float, cost) -> dict:
    rate = rate_for(tau)
    chooser = ChainDrafter(cost, max_tokens=BLOCK - 1)
    chooser.tried[0, :], chooser.accepted[0, :] = 1e9, rate * 1e9
    length = chooser.best_length(0, BLOCK - 1, 1, 1.0)
    tokens = 1 + float(np.cumprod([rate] * length).sum())
    round_cost = cost(1 + length) + draft_share * cost(BLOCK)
    return {"rate": rate, "chain": length, "tokens_per_round": tokens, "round_steps": round_cost,
            "speedup": tokens / round_cost}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "results" / "dflash-prediction.json")
    args = parser.parse_args()
    curves = dict(CURVES)
    try:  # this CPU's curve for SmolLM2, where it has been timed
        from mlx_eagle import load
        from mlx_eagle.costs import verify_costs

        model, _ = load()
        measured = verify_costs(model)
        curves["this CPU (SmolLM2 float32, measured)"] = measured.steps
    except Exception as exc:  # noqa: BLE001 - the GPU rows need no model
        print(f"(no CPU curve: {exc})")
    results = []
    for name, tau, share, peer, source in DRAFTERS:
        for curve, cost in curves.items():
            row = {"drafter": name, "published_tau": tau, "curve": curve, "peer": peer, "source": source,
                   **predict(tau, share, cost)}
            results.append(row)
            print(f"{name:40s} {curve:42s} chain {row['chain']:2d}  {row['tokens_per_round']:.2f} tokens / "
                  f"{row['round_steps']:.2f} steps = {row['speedup']:.2f}x  (peer: {peer or '-'})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
