"""The training recipe, one lever at a time at equal compute (README, "What each lever buys").

Every run trains an EAGLE-3 head for SmolLM2-135M-Instruct from scratch on the same
ShareGPT pieces (--subset of every-turn dialogues, the same batches in the same order),
reading the target's states from one --store-features store filled once, and changes one
flag against the reference (TTT 3, lr 5e-4, 3% warm-up then cosine, draft vocabulary
8,192; the 4,096 run's vocabulary is made by the trainer the same way). TTT 5 gets 3/5
of the steps: the same number of unrolled head passes. Each head is then measured on
held-out dialogues (pieces no run trained on) teacher-forced: how often its top draft at
each unrolled depth is the target's greedy choice over the whole vocabulary, over every
answer token, with no noise and no masking whatever the run trained with, and the chain
tau those rates imply (1 + a1 + a1 a2 + ...). Resumable: the store, each run and the
evaluation pick up where they were.

    python -m mlx_eagle.train --out x --data DATA --seq-len 512 --prepare-only   # the tokens and vocabulary
    python benchmarks/recipe_ablations.py DATA RUNS [--seq-len 512] [--subset 500] [--steps 100]
"""

import argparse
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from typing import List, Optional

from mlx_eagle.cli import use_fast_blas
from mlx_eagle.data import load_dialogues
from mlx_eagle.heads import load_head
from mlx_eagle.plan import load
from mlx_eagle.target import default_taps, lm_head
from mlx_eagle.train import StateStore, make_batch, shift, ttt_unroll
from mlx_eagle.train.__main__ import main as train

DEPTH = 5  # unrolled depths measured, deeper than TTT 3 trains, so every run is measured alike
RUNS = {  # name: (flags changed against the reference, share of the reference's steps)
    "reference": ([], 1.0),
    "ttt-5": (["--ttt-steps", "5"], 0.6),
    "lr-2e-4": (["--lr", "2e-4"], 1.0),
    "no-warm-up": (["--warmup", "0"], 1.0),
    "mask-outside-draft": (["--mask-outside-draft"], 1.0),
    "train-embeddings": (["--train-embeddings"], 1.0),
    "feature-noise-0.2": (["--feature-noise", "0.2"], 1.0),
    "draft-vocab-4096": (["--draft-vocab", "4096"], 1.0),
    # A quarter of the pieces are the target's own answers to ShareGPT first prompts: the
    # reference's first 375 pieces and 125 self-distilled ones, with a store of their own.
    "self-distilled-mix": (["--subset", "375", "--mix-self", "125", "--store-features", "{runs}/store-self-mix"], 1.0),
}


def held_out_agreement(model, head, store: StateStore, pieces) -> list:
    """How often the head's top draft at each unrolled depth is the target's own greedy
    choice (over its whole vocabulary, as greedy verification accepts), over all answer tokens."""
    agreed, counted = np.zeros(DEPTH), np.zeros(DEPTH)
    for i, piece in enumerate(pieces):
        batch = make_batch([piece])
        features, last = store.batch([i], 1, len(piece[0]))
        target_choice = mx.argmax(lm_head(model, shift(last, -1)), axis=-1)
        position = mx.arange(len(piece[0]))[None]
        for depth, logits in ttt_unroll(head, model, batch["tokens"], features, DEPTH):
            valid = batch["mask"] & (position >= depth)
            drafted = head.target_ids(mx.argmax(logits, axis=-1))
            agreed[depth] += int(((drafted == target_choice) & valid).sum())
            counted[depth] += int(valid.sum())
    return (agreed / counted).tolist()


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", type=Path, help="--data of a --prepare-only run with the same --seq-len")
    parser.add_argument("runs", type=Path, help="where the runs, their heads and the stores go")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--subset", type=int, default=500, help="pieces trained on")
    parser.add_argument("--held-out-pieces", type=int, default=16)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--tokens-per-batch", type=int, default=2048)
    parser.add_argument("--only", nargs="*", help="these runs only")
    parser.add_argument("--no-compile", action="store_true", help="train uncompiled (compiling costs minutes once)")
    parser.add_argument("--held-out", type=int, default=20, help="the --held-out of the --prepare-only run")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "recipe-ablations.json")
    args = parser.parse_args(argv)
    use_fast_blas()
    common = ["--data", str(args.data), "--seq-len", str(args.seq_len), "--subset", str(args.subset),
              "--tokens-per-batch", str(args.tokens_per_batch), "--store-features", str(args.runs / "store"),
              "--checkpoint-every", "20", "--skip-eval", "--ttt-steps", "3", "--lr", "5e-4"]
    common += ["--held-out", str(args.held_out)] + (["--no-compile"] if args.no_compile else [])
    for name, (flags, share) in RUNS.items():
        if args.only and name not in args.only:
            continue
        steps = round(args.steps * share)
        print(f"== {name}: {' '.join(flags) or 'the reference'}, {steps} steps", flush=True)
        train(["--out", str(args.runs / name), "--work", str(args.runs / f"{name}.work"), "--steps", str(steps),
               "--warmup", str(max(1, round(0.03 * steps)))] + common + [f.format(runs=args.runs) for f in flags])

    model, _ = load(None)
    pieces, _ = load_dialogues(next(args.data.glob(f"dialogues-{args.seq_len}-*-{args.held_out}.npz")))
    trained = set(np.random.default_rng(0).permutation(len(pieces))[: args.subset].tolist())  # as --subset (seed 0)
    held = [pieces[i] for i in np.random.default_rng(1).permutation(len(pieces)) if int(i) not in trained]
    held = held[: args.held_out_pieces]
    store = StateStore(args.runs / "held-out-store", model, held, default_taps(model.args.num_hidden_layers),
                       seq_len=args.seq_len)
    store.fill(args.tokens_per_batch)
    table = {}
    for name in RUNS:
        work = args.runs / f"{name}.work"
        if not (args.runs / name / "config.json").exists():
            continue
        log = [json.loads(line) for line in (work / "log.jsonl").read_text().splitlines()]
        head = load_head(args.runs / name, model)
        head.set_dtype(mx.float32)
        rates = held_out_agreement(model, head, store, held)
        tau = 1 + sum(float(np.prod(rates[: k + 1])) for k in range(DEPTH))
        table[name] = {"flags": RUNS[name][0], "steps": log[-1]["step"], "answer_tokens": log[-1]["tokens"],
                       "train_tokens_per_s": log[-1]["tokens_per_s"], "held_out_agreement_by_depth": rates,
                       "chain_tau_implied": tau, "last_loss": log[-1]["loss"]}
        print(f"{name:20} agreement by depth {' '.join(f'{r:.3f}' for r in rates)}  chain tau {tau:.3f}  "
              f"{log[-1]['tokens_per_s']:.0f} answer tokens/s", flush=True)
    held_tokens = int(sum(int(answer.sum()) for _, answer in held))
    args.out.write_text(json.dumps({"seq_len": args.seq_len, "subset": args.subset, "steps": args.steps,
                                    "tokens_per_batch": args.tokens_per_batch, "held_out_pieces": len(held),
                                    "held_out_answer_tokens": held_tokens, "runs": table}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
