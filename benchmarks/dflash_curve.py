"""A DFlash or DSpark training run's tau against the tokens it has trained on, from its log.

    python benchmarks/dflash_curve.py WORK/log.jsonl [--out benchmarks/results/dflash-curve]

The log holds, per step, the drafter's agreement with the target at each block position
on that step's blocks. A chain of its drafts (block - 1 for DFlash, block for DSpark) yields
tau = 1 + sum over k of a_1 ... a_k, taking the positions as independent (they are not:
a right draft at position k is likelier after right ones before it, so this estimate is
low), averaged over windows of 20 steps. Writes OUT.json and OUT.png; a measured tau is
added: the trainer's held-out eval.json (--measured), or the run's latest checkpoint decoding
the first MT-bench first turns (--checkpoint).
"""

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
from typing import List, Optional

HERE = Path(__file__).resolve().parent


def cumulative_tokens(entries: list) -> list:
    """Tokens trained on up to each step (a resumed run's log counts again from 0)."""
    total, previous, out = 0, 0, []
    for entry in entries:
        total += entry["tokens"] - previous if entry["tokens"] > previous else entry["tokens"]
        previous = entry["tokens"]
        out.append(total)
    return out


def curve(entries: list, window: int = 20) -> list:
    entries = [dict(e, tokens=t) for e, t in zip(entries, cumulative_tokens(entries))]
    points = []
    for start in range(0, len(entries) - window + 1, window):
        part = entries[start:start + window]
        accuracy = np.mean([e["step_accuracy"] for e in part], axis=0)
        points.append({"step": part[-1]["step"], "tokens": part[-1]["tokens"],
                       "tau_estimate": float(1 + np.cumprod(accuracy).sum()),
                       "accuracy_by_position": [float(a) for a in accuracy]})
    return points


def checkpoint_tau(directory: Path, model_path, mask_token, turns: int, write=None) -> dict:
    """tau on chains of block - 1 over the first MT-bench first turns, 64 tokens each,
    decoded with a training checkpoint's drafter (built as the trainer built it)."""
    from mlx_eagle import load
    from mlx_eagle.data import mtbench_questions
    from mlx_eagle.train.dflash import block_tau
    from mlx_eagle.train.families import drafter_to_train
    from mlx_eagle.train.recipe import TrainConfig

    state = json.loads((directory / "state.json").read_text())
    model, tokenizer = load(model_path)
    config = TrainConfig(**state["config"])
    if mask_token is not None or config.mask_token is None:  # older checkpoints name no mask token
        config = replace(config, mask_token=mask_token if mask_token is not None else (tokenizer.unk_token_id or 0))
    drafter = drafter_to_train(model, config)
    drafter.load_weights(str(directory / "head.safetensors"))
    if write is not None:  # in the layout its --draft kind reads (a DFlash or a DSpark drafter)
        from mlx_eagle.train.families import FAMILIES

        FAMILIES[config.family].code().save(drafter, write)
    prompts = [q["turns"][0] for q in mtbench_questions()[:turns]]
    return dict(block_tau(model, drafter, tokenizer, prompts, 64), step=state["step"])


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "dflash-curve")
    parser.add_argument("--measured", type=Path, help="the run's eval.json (held-out tau, decoded)")
    parser.add_argument("--checkpoint", action="store_true", help="also decode the first --turns MT-bench first "
                        "turns with the run's latest checkpoint (beside the log) and report its tau")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--model", help="the run's target (default: SmolLM2)")
    parser.add_argument("--mask-token", type=int, help="the run's --mask-token, if it gave one")
    parser.add_argument("--write", type=Path, help="with --checkpoint: also write its drafter there, in the z-lab "
                        "layout (for --draft and the bench)")
    args = parser.parse_args(argv)
    if args.checkpoint:
        from mlx_eagle.cli import use_fast_blas

        use_fast_blas()  # (it may start this script again, with OpenBLAS preloaded)
    entries = [json.loads(line) for line in args.log.read_text().splitlines() if line.strip()]
    points = curve(entries)
    result = {"log": str(args.log), "points": points}
    if args.measured:
        result["measured"] = json.loads(args.measured.read_text())
    if args.checkpoint:
        result["measured"] = checkpoint_tau(args.log.parent / "checkpoint", args.model, args.mask_token, args.turns,
                                            args.write)
        print(f"checkpoint at step {result['measured']['step']}: MT-bench tau {result['measured']['tau']:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    axis.plot([p["tokens"] for p in points], [p["tau_estimate"] for p in points], marker="o", label="estimated")
    if args.measured:
        axis.scatter([cumulative_tokens(entries)[-1]], [result["measured"]["tau"]], color="red",
                     label="measured, held out")
    axis.set(xlabel="training tokens", ylabel="tau, chain of block - 1", title="block drafter for SmolLM2 (CPU)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(args.out.with_suffix(".png"), dpi=110)
    for p in points:
        print(f"step {p['step']:5d}  tokens {p['tokens']:9,d}  tau estimate {p['tau_estimate']:.2f}")


if __name__ == "__main__":
    main()
