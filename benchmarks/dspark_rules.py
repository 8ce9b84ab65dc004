"""Which prefix of a DSpark block to verify, rule against rule on the same drafts: the
runtime's (the prefix with the most expected tokens per unit of what verifying it costs on
the device's curve, from the confidences as this conversation calibrated them so far),
the same from the raw confidences, the published threshold rule (cut the block at the
first draft whose confidence, or whose chain's product of confidences, falls below p_min:
llama.cpp #25173's confidence truncation), measured acceptance by position (DFlash's
rule, no confidence head), and the whole block.

    python benchmarks/dspark_rules.py --draft DIR [--model GGUF_OR_DIR] [--prompts 10]
        [--max-tokens 64] [--out benchmarks/results/dspark-rules.json]

Greedy decoding of MT-bench first turns verifies every block whole (a flat curve),
recording each draft's confidence and how many the target accepted. Each rule then picks a
length per round, online (what it learns it learns from what it would have verified): its
tokens per forward are 1 + min(accepted, length), and its modelled speed is tokens per
unit of the curve's cost of verifying 1 + length tokens, on this CPU's measured curve and
on Apple-GPU-like ones (drafting's own cost left out: the same block for every rule). A
model, not a measurement of wall time.
"""

import argparse
import json
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np

from mlx_eagle.cli import use_fast_blas

ROOT = Path(__file__).resolve().parent.parent
APPLE_CURVES = {  # a forward over k tokens, in plain steps (as benchmarks/drafter_prediction.py's)
    "Apple GPU (flat: 16 tokens ~ 1.3 steps)": lambda k: 1.0 + 0.02 * (k - 1),
    "Apple GPU, 4-bit, steep (8 tokens ~ 6 steps)": lambda k: 1.0 + 5.0 / 7.0 * (k - 1),
}
THRESHOLDS = (0.1, 0.3, 0.5, 0.7)


def record_rounds(model, tokenizer, drafter, prompts: List[str], max_tokens: int) -> List[dict]:
    """Each round's raw confidences and accepted drafts, whole blocks verified."""
    from mlx_eagle.decoder import SpeculativeDecoder
    from mlx_eagle.drafters.dspark import DSparkDrafter
    from mlx_eagle.replies import chat_tokens
    from mlx_eagle.verify import Sampling

    rounds = []
    for prompt in prompts:
        chains = DSparkDrafter(drafter, model, lambda k: 1.0)
        learn = chains.learn

        def recorded(outcome, learn=learn, chains=chains):
            rounds.append({"confidence": chains._confidence.tolist(), "accepted": outcome.accepted})
            learn(outcome)

        chains.learn = recorded
        decoder = SpeculativeDecoder(model, chains, Sampling())
        tokens = [decoder.prefill(chat_tokens(tokenizer, [{"role": "user", "content": prompt}]))]
        while len(tokens) < max_tokens and tokens[-1] not in tokenizer.eos_token_ids:
            tokens += decoder.round(max_tokens - len(tokens)).tokens
    return rounds


def simulate(rounds: List[dict], rule: str, curve: Callable[[int], float], block: int) -> Dict[str, float]:
    """Tokens per forward and modelled speed against plain decoding of ``rule`` on ``curve``."""
    from mlx_eagle.drafters.chains import ChainDrafter
    from mlx_eagle.drafters.dspark import Calibration

    calibration, measured = Calibration(), ChainDrafter(curve, block)
    tokens = cost = 0.0
    for one in rounds:
        raw, accepted = np.array(one["confidence"]), one["accepted"]
        if rule == "whole block":
            length = len(raw)
        elif rule.startswith("threshold"):
            p_min = float(rule.split("=")[1])
            score = np.cumprod(raw) if "product" in rule else raw
            below = np.flatnonzero(score < p_min)
            length = int(below[0]) if below.size else len(raw)
        elif rule == "measured acceptance (no confidence)":
            length = measured.best_length(0, len(raw), 1, 1.0)
        else:
            reach = np.cumprod(calibration.adjusted(raw) if "calibrated" in rule else raw)
            length = measured.best_prefix(reach, 1, 1.0)
        if length:
            measured.record_chain(0, length, min(accepted, length))
            calibration.record(raw, length, min(accepted, length))
        tokens += 1 + min(accepted, length)
        cost += curve(1 + length)
    return {"tokens_per_forward": tokens / len(rounds), "speed_vs_plain": tokens / cost}


def main(argv: Optional[List[str]] = None) -> None:
    use_fast_blas()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", required=True, help="a DSpark drafter directory")
    parser.add_argument("--model", help="the target (default: SmolLM2)")
    parser.add_argument("--prompts", type=int, default=10, help="MT-bench first turns")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "dspark-rules.json")
    args = parser.parse_args(argv)

    from mlx_eagle.costs import verify_costs
    from mlx_eagle.data import mtbench_questions
    from mlx_eagle.drafters.dspark import load
    from mlx_eagle.models import load_target

    model, tokenizer, _ = load_target(args.model)
    drafter = load(Path(args.draft), model)
    block = drafter.config.block_size
    prompts = [question["turns"][0] for question in mtbench_questions()[:args.prompts]]
    rounds = record_rounds(model, tokenizer, drafter, prompts, args.max_tokens)
    curves = {"this CPU (measured)": verify_costs(model).at(), **APPLE_CURVES}
    rules = ["runtime: best prefix, calibrated", "best prefix, raw confidences",
             *[f"threshold p_min={p}" for p in THRESHOLDS],
             *[f"threshold on the product, p_min={p}" for p in THRESHOLDS],
             "measured acceptance (no confidence)", "whole block"]
    table = {curve: {rule: simulate(rounds, rule, price, block) for rule in rules} for curve, price in curves.items()}
    result = {"draft": str(args.draft), "rounds": len(rounds), "prompts": args.prompts, "max_tokens": args.max_tokens,
              "mean_accepted": float(np.mean([r["accepted"] for r in rounds])), "rules": table}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for curve, rows in table.items():
        print(f"\n{curve}: {len(rounds)} rounds, {result['mean_accepted']:.2f} drafts accepted a round of whole blocks")
        print(f"{'rule':48} {'tokens/forward':>14} {'speed vs plain':>14}")
        for rule, row in rows.items():
            print(f"{rule:48} {row['tokens_per_forward']:14.2f} {row['speed_vs_plain']:14.2f}")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
