"""What the cost model predicts for published drafters (DFlash block drafters and the MTP
modules models ship) on Apple-GPU-like verify curves and on this CPU's measured one, next
to what peers measured on Macs. A prediction, not a measurement: no Apple GPU runs here.

    python benchmarks/drafter_prediction.py [--out benchmarks/results/drafter-prediction.json]

For each drafter, acceptance by position is taken as one rate r at every position, chosen
so that its published chain yields the published tau (1 + r + ... + r^n). The chain is
sized as the runtime sizes it while decoding (ChainDrafter.best_length on the curve, with
the measured rates and the drafter's own cost per draft): where no chain pays, none is
drafted and the round is a plain step (1.00x). A round costs a verify pass over 1 + L
tokens plus the drafting: a DFlash drafter runs its layers once over the whole block (a
share of the target's layers); an MTP module runs once per draft token, one decoder layer
and the target's LM head each time (a share of the target's active weights, which a
decoding step reads). Predicted speedup = tokens per round / round cost, in plain steps.
"""

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import numpy as np

from mlx_eagle.drafters.chains import ChainDrafter

HERE = Path(__file__).resolve().parent
BLOCK = 16


def mtp_share(active: float, layers: int, hidden: int, vocab: int) -> float:
    """One MTP draft step as a share of a plain decoding step, by weights read: one decoder
    layer (the active weights outside the embedding and LM head, per layer) and the LM head."""
    head = hidden * vocab
    return (head + (active - 2 * head) / layers) / active


@dataclass(frozen=True)
class Published:
    name: str
    kind: str  # "dflash": one pass over the block; "mtp": one step per draft token
    tau: float  # published tokens per round at temperature 0 ...
    drafts: int  # ... over a chain of this many drafts
    share: float  # DFlash: its layers / the target's; MTP: one step's share of a plain step (mtp_share)
    peer: Optional[str]  # what a peer measured on a Mac
    source: str  # ../shared/DRAFTERS.md


DRAFTERS = [
    Published("z-lab Qwen3-8B-DFlash-b16, MT-bench", "dflash", 4.24, BLOCK - 1, 5 / 36, None, "arXiv 2602.06036"),
    Published("z-lab Qwen3-8B-DFlash-b16, GSM8K", "dflash", 6.54, BLOCK - 1, 5 / 36, None, "arXiv 2602.06036"),
    Published("Qwen3.5-9B DFlash, MT-bench", "dflash", 5.5, BLOCK - 1, 5 / 32, "4.37x (dflash-mlx, M5 Max)",
              "bstnxbt/dflash-mlx README"),
    # mlx-vlm #2040: a Qwen MTP module at depth 4, 3.72 tokens a round (90.7% acceptance), 1.55x.
    Published("Qwen3.5-9B MTP module (depth 4, 3.72 tokens/round)", "mtp", 3.72, 4,
              mtp_share(9e9, 32, 4096, 248_320), "1.55x (mlx-vlm #2040)", "Blaizzy/mlx-vlm #2040"),
    # MTPLX drafts for Qwen3-Next-80B-A3B (3B active, 48 layers): the same acceptance taken.
    Published("Qwen3-Next-80B-A3B MTP module (depth 4, 3.72 tokens/round)", "mtp", 3.72, 4,
              mtp_share(3e9, 48, 2048, 151_936), "1.6x M4 mini, 2.24x M5 Max, ~1.45x M1 Max (MTPLX)",
              "youssofal/MTPLX"),
]

CURVES = {  # a forward over k new tokens, in plain steps
    "Apple GPU (flat: 16 tokens ~ 1.3 steps)": lambda k: 1.0 + 0.02 * (k - 1),
    # EAGLE_FACTS.md: at 4 bits, 8 rows cost about 6x one row on an Apple GPU (MLX issue reports).
    "Apple GPU, 4-bit, steep (8 tokens ~ 6 steps)": lambda k: 1.0 + 5.0 / 7.0 * (k - 1),
}


def rate_for(tau: float, drafts: int) -> float:
    """The one acceptance rate r with 1 + r + ... + r^drafts = tau."""
    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        if 1 + sum(middle ** i for i in range(1, drafts + 1)) < tau:
            low = middle
        else:
            high = middle
    return low


def predict(drafter: Published, cost) -> dict:
    rate = rate_for(drafter.tau, drafter.drafts)
    step_cost = drafter.share if drafter.kind == "mtp" else 0.0
    chooser = ChainDrafter(cost, max_tokens=drafter.drafts, step_cost=step_cost)
    chooser.tried[0, :], chooser.accepted[0, :] = 1e9, rate * 1e9
    # (A DFlash pass over the block is paid whatever the chain: the runtime drafts none where
    # no chain pays once it is paid, which the comparison with 1.0 below stands for.)
    length = chooser.best_length(0, drafter.drafts, 1, 1.0)
    tokens = 1 + float(np.cumprod([rate] * length).sum())
    if drafter.kind == "dflash":
        drafting = drafter.share * cost(BLOCK) if length else 0.0
    else:
        drafting = length * step_cost
    round_cost = cost(1 + length) + drafting
    speedup = tokens / round_cost
    if speedup < 1.0:  # (held back: a drafter whose rounds lose drafts nothing, ChainDrafter and EagleDrafter)
        length, tokens, round_cost, speedup = 0, 1.0, 1.0, 1.0
    return {"rate": rate, "chain": length, "tokens_per_round": tokens, "round_steps": round_cost,
            "speedup": speedup}


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "results" / "drafter-prediction.json")
    args = parser.parse_args(argv)
    curves = dict(CURVES)
    try:  # this CPU's curve for SmolLM2, where it has been timed
        from mlx_eagle import load
        from mlx_eagle.costs import verify_costs

        model, _ = load()
        measured = verify_costs(model)
        curves["this CPU (SmolLM2 float32, measured)"] = measured.at().steps
    except Exception as exc:  # noqa: BLE001 - the GPU rows need no model
        print(f"(no CPU curve: {exc})")
    results = []
    for drafter in DRAFTERS:
        for curve, cost in curves.items():
            row = {"drafter": drafter.name, "kind": drafter.kind, "published_tau": drafter.tau,
                   "published_drafts": drafter.drafts, "draft_share": drafter.share, "curve": curve,
                   "peer": drafter.peer, "source": drafter.source, **predict(drafter, cost)}
            results.append(row)
            print(f"{drafter.name:58s} {curve:44s} chain {row['chain']:2d}  {row['tokens_per_round']:.2f} tokens / "
                  f"{row['round_steps']:.2f} steps = {row['speedup']:.2f}x  (peer: {drafter.peer or '-'})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
