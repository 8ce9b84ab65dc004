"""Train a drafter (an EAGLE head or a DFlash block drafter) for any supported target,
resumably (the mlx_eagle.train command).

    python -m mlx_eagle.train --out my-head [--model M] [--family eagle3] [--answers sharegpt]
"""

from __future__ import annotations

import json
import sys
import time
from argparse import ArgumentParser, Namespace
from dataclasses import fields, replace
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..architectures import target_identity
from ..cli import add_model_arguments, new_parser, run_cli
from ..errors import UserError
from ..files import replace_directory, write_atomically, write_npz
from .families import FAMILIES, drafter_to_train
from .recipe import TrainConfig

RECIPE_HELP = {  # TrainConfig's settings, as flags (a family's own are prefixed with its title)
    "steps": "optimizer steps",
    "tokens_per_batch": "tokens in one micro-batch (rows times padded length)",
    "grad_accum": "micro-batches per optimizer step",
    "seq_len": "longest piece, in tokens (longer dialogues are cut)",
    "warmup": "steps of linear learning-rate warm-up, then cosine decay",
    "ttt_steps": "training-time test: draft steps unrolled per position",
    "checkpoint_every": "steps between checkpoints (a killed run resumes from the last)",
    "seed": "seed for the head's initial weights and the batch order",
    "pad_multiple": "batch lengths are rounded up to this, so compiled steps see few shapes",
    "lr": "peak learning rate (AdamW)",
    "weight_decay": "AdamW weight decay",
    "clip": "gradient norm clip",
    "step_decay": "weight of unrolled step k's loss is this to the power k",
    "feature_noise": "uniform noise in (-X, X) on the target's states, as EAGLE-1 trains",
    "block_size": "tokens a block holds: the root and its masks (DFlash drafts block-size - 1 tokens, DSpark "
                  "block-size; DSpark's published blocks hold 7)",
    "anchors": "blocks trained per sequence, at random positions redrawn every step",
    "dflash_layers": "the drafter's decoder layers",
    "markov_rank": "the Markov head's rank (the previous token's embedding width)",
    "mask_token": "the token id that fills a block after its root (default: the tokenizer's unknown token, else 0)",
    "mask_outside_draft": "positions whose target choice is no draft token do not count in the loss",
    "train_embeddings": "train an embedding of the head's own (a copy of the target's to start) instead of "
                        "reading the target's",
}


def recipe_help(name: str) -> str:
    owners = [family.title for family in FAMILIES.values() if name in family.settings]
    return (f"{', '.join(owners)}: " if owners else "") + RECIPE_HELP[name]


def build_parser() -> ArgumentParser:
    parser = new_parser("mlx_eagle.train", __doc__)
    parser.add_argument("--out", required=True, type=Path, help="the drafter directory to write")
    add_model_arguments(parser, draft=False, tree=False, shards=False)
    parser.add_argument("--work", type=Path, help="checkpoints, log and curves (default: OUT.work)")
    parser.add_argument("--data", type=Path, help="tokenized data and vocabularies, shareable between runs "
                        "(default: --work)")
    parser.add_argument("--family", choices=list(FAMILIES), default="eagle3", help="what to train: " + "; ".join(
        f"{family.name}: {family.title} ({family.about})" for family in FAMILIES.values()))
    parser.add_argument("--answers", choices=["sharegpt", "self"], default="sharegpt",
                        help="ShareGPT's own answers, every turn of every dialogue, or first prompts "
                        "answered by the target itself (self-distillation)")
    parser.add_argument("--prompts", type=int, help="dialogues (sharegpt; default all) or prompts (self; "
                        "default 2000) to train on")
    parser.add_argument("--held-out", type=int, default=20, help="further prompts kept for measuring acceptance")
    parser.add_argument("--max-answer-tokens", type=int, default=256, help="self-distilled answers' length")
    parser.add_argument("--draft-vocab", type=int, default=8192, help="the draft vocabulary's size, for "
                        + ", ".join(f.title for f in FAMILIES.values() if f.draft_vocabulary))
    defaults = TrainConfig()
    for setting in fields(TrainConfig):
        if setting.name in ("family", "compile"):
            continue
        flag, default = f"--{setting.name.replace('_', '-')}", getattr(defaults, setting.name)
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true", help=recipe_help(setting.name))
        else:
            parser.add_argument(flag, type=type(default) if default is not None else int, default=default,
                                help=recipe_help(setting.name))
    parser.add_argument("--mix-self", type=int, metavar="N", help="with --answers sharegpt: also train on N "
                        "ShareGPT first prompts answered by the target itself (self-distilled, made as --answers "
                        "self makes them; prompts over 256 tokens are skipped)")
    parser.add_argument("--subset", type=int, help="train on this many of the pieces, chosen at random "
                        "(for measuring what more data buys)")
    parser.add_argument("--save-dtype", choices=["float16", "bfloat16", "float32"], default="float16",
                        help="weights of the written head (training runs in float32)")
    parser.add_argument("--store-features", type=Path, metavar="DIR", help="compute the target's states once "
                        "and keep them in DIR (float16, ~4.6 KB a token for SmolLM2), shareable between runs on the "
                        "same pieces, instead of recomputing them for every batch")
    parser.add_argument("--prepare-only", action="store_true", help="stop after the data and vocabulary "
                        "(and the stored states, with --store-features)")
    parser.add_argument("--skip-eval", action="store_true", help="write the head without measuring acceptance")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="run the training step "
                        "uncompiled (mx.compile traces each new batch shape once)")
    parser.add_argument("--time-budget", type=float, metavar="SECONDS", help="train as many steps as fit in "
                        "SECONDS of wall clock (--steps is then ignored): a few probe steps measure a step's time, "
                        "the schedule is sized to end in time, and the head is written after every sixth of the "
                        "steps, so a run cut off still leaves its latest head (for a lent GPU's fixed time)")
    parser.add_argument("--init", type=Path, metavar="HEAD", help="start from a drafter this trainer wrote (the "
                        "same draft vocabulary), to add epochs to it")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def checked(args: Namespace) -> Tuple[TrainConfig, Path]:
    """The recipe and the work directory, or one line naming what is wrong, before the
    model loads."""
    config = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
    for name, value, low in (("draft-vocab", args.draft_vocab, 1), ("held-out", args.held_out, 0),
                             ("prompts", args.prompts, 1), ("subset", args.subset, 1), ("mix-self", args.mix_self, 1),
                             ("max-answer-tokens", args.max_answer_tokens, 1)):
        if value is not None and value < low:
            raise UserError(f"--{name} must be {low} or more, not {value}")
    if args.time_budget is not None and not args.time_budget > 0:
        raise UserError(f"--time-budget must be a number of seconds above 0, not {args.time_budget}")
    if args.init is not None and not (args.init / "config.json").exists():
        raise UserError(f"--init {args.init} is not a head directory (no config.json); pass a head this trainer wrote")
    if args.mix_self and args.answers != "sharegpt":
        raise UserError("--mix-self adds the target's own answers to ShareGPT's; it needs --answers sharegpt")
    work = args.work or args.out.with_name(args.out.name + ".work")
    for directory, use, flag in ((work, "for checkpoints and logs", "--work"),
                                 (args.store_features, "to keep the target's states", "--store-features")):
        if directory is None:
            continue
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"cannot use {directory} {use} ({exc.strerror}); pass another {flag}") from None
    return config, work


def training_pieces(args: Namespace, model, tokenizer, root: Path, config: TrainConfig,
                    progress: bool) -> Tuple[List, List[str], Path]:
    """(pieces, held-out prompts, the draft vocabulary's file), each made once in ``root``."""

    from .pieces import d2t_t2d, draft_vocabulary, self_distilled_pieces, sharegpt_pieces

    if args.answers == "sharegpt":
        pieces, held_out = sharegpt_pieces(tokenizer, root, config.seq_len, args.prompts, args.held_out, progress)
        vocab_path = root / f"vocab-sharegpt-{args.prompts or 'all'}-{args.draft_vocab}.npz"
    else:
        pieces, held_out = self_distilled_pieces(model, tokenizer, root, args.prompts or 2000, args.held_out,
                                                 args.max_answer_tokens, progress)
        vocab_path = root / f"vocab-self-{args.draft_vocab}.npz"
    if not vocab_path.exists():
        used = draft_vocabulary(pieces, model.args.vocab_size, args.draft_vocab)
        d2t, t2d = d2t_t2d(used, model.args.vocab_size)
        write_npz(vocab_path, used=used, d2t=d2t, t2d=t2d)
    if args.subset:
        chosen = np.random.default_rng(config.seed).permutation(len(pieces))[: args.subset]
        pieces = [pieces[i] for i in sorted(chosen)]
    if args.mix_self:  # after --subset, so that --subset N --mix-self M trains on N + M pieces
        pieces = pieces + self_distilled_pieces(model, tokenizer, root, args.mix_self, 0, args.max_answer_tokens,
                                                progress)[0]
    return pieces, held_out, vocab_path


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    started = time.monotonic()
    config, work = checked(args)
    # What --help needs stops here; what training needs loads now.


    from ..heads import TARGET_FILE
    from ..plan import load
    from .store import StateStore
    from .trainer import Trainer, plot_curves, steps_within

    progress = not args.quiet
    world = mx.distributed.init()
    model, tokenizer = load(args.model)
    family = FAMILIES[config.family].code()
    if config.mask_token is None:
        config = replace(config, mask_token=tokenizer.unk_token_id or 0)
    root = args.data or work
    if world.size() > 1 and not list(root.glob("vocab-*.npz")):
        raise UserError(f"prepare the data once without mlx.launch first: {parser.prog} ... --prepare-only")
    pieces, held_out, vocab_path = training_pieces(args, model, tokenizer, root, config, progress)
    used = np.load(vocab_path)["used"] if FAMILIES[config.family].draft_vocabulary else None
    print(f"data: {len(pieces)} pieces, {sum(int(a.sum()) for _, a in pieces):,} answer tokens, {len(held_out)} "
          f"held-out prompts, draft vocabulary {vocab_path.name} (in {root}), {time.monotonic() - started:.0f} s",
          file=sys.stderr)
    head = drafter_to_train(model, config, used, args.init)
    store = None
    if args.store_features:
        store = StateStore(args.store_features, model, pieces, head.taps(model.args.num_hidden_layers),
                           config.seq_len)
        if world.size() > 1 and store.missing():
            raise UserError(f"fill {args.store_features} once without mlx.launch first: {parser.prog} ... "
                            "--store-features DIR --prepare-only")
        speed = store.fill(config.tokens_per_batch, progress)
        if speed:
            print(f"target states: {store.meta['tokens']:,} tokens in {args.store_features}, {speed:.0f} tokens/s")
    if args.prepare_only:
        print("prepared: train with the same --data/--work to use it", file=sys.stderr)
        return

    def write_head() -> None:
        def fill(staging: Path) -> None:
            family.save(head, staging, dtype=getattr(mx, args.save_dtype))
            # Whom it drafts for, so that shipped in mlx_eagle/weights/ it is found by --draft auto.
            (staging / TARGET_FILE).write_text(json.dumps(target_identity(model), indent=1) + "\n")

        replace_directory(args.out, fill, overwrite=True)

    def make_trainer(run_config: TrainConfig, run_work: Path) -> Trainer:
        return Trainer(model, head, pieces, run_config, run_work, used=used, progress=progress, store=store)

    if args.time_budget is not None:
        config = steps_within(make_trainer, config, args.time_budget - (time.monotonic() - started), work)
        head = drafter_to_train(model, config, used, args.init)
    trainer = make_trainer(config, work)
    chunk = max(1, config.steps // 6) if args.time_budget is not None else config.steps
    tic, first = time.monotonic(), trainer.step
    while trainer.step < config.steps:
        trainer.run(stop_after=min(config.steps, trainer.step + chunk))
        if world.rank() == 0 and trainer.step < config.steps:
            write_head()  # a run cut off at its time limit leaves its latest head
    if world.rank() != 0:
        return
    write_head()
    plot_curves(work / "log.jsonl", work / "curves.png")
    print(f"trained steps {first + 1}-{trainer.step} in {time.monotonic() - tic:.0f} s; wrote {args.out}, curves in "
          f"{work / 'curves.png'}", file=sys.stderr)
    if args.skip_eval:
        return
    tic = time.monotonic()
    result, line = family.evaluate(model, tokenizer, args.out, held_out, config, progress)
    result.update(answers=args.answers, steps=config.steps,
                  tokens=int(sum(int(answer[:config.seq_len].sum()) for _, answer in pieces)))
    write_atomically(work / "eval.json", json.dumps(result, indent=2))
    print(f"evaluated in {time.monotonic() - tic:.0f} s: {line}; wrote {args.out}")


def cli() -> None:
    """Console-script entry point."""
    run_cli(main)


if __name__ == "__main__":
    cli()
