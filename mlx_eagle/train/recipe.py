"""The training recipe: its settings, checked once, the learning-rate schedule and how an
epoch is cut into packed micro-batches (a pure function of seed and epoch, so a resumed
run trains on exactly the batches an uninterrupted one would)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

import mlx.optimizers as optim
import numpy as np

from ..errors import UserError
from .families import FAMILIES


@dataclass
class TrainConfig:
    family: str = "eagle3"
    steps: int = 2000
    tokens_per_batch: int = 4096  # rows x padded length of one micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    seq_len: int = 1024
    lr: float = 5e-4
    warmup: int = 100
    weight_decay: float = 0.0
    clip: float = 0.5
    ttt_steps: int = 5
    step_decay: float = 0.8
    checkpoint_every: int = 200
    seed: int = 0
    pad_multiple: int = 64  # batch lengths are rounded up to this, so compiled steps see few shapes
    compile: bool = True
    # Recipe levers (off by default; README's ablations):
    mask_outside_draft: bool = False  # positions whose target choice is outside the draft vocabulary do not count
    feature_noise: float = 0.0  # uniform noise in (-x, x) on the target's states, as EAGLE-1 trains
    train_embeddings: bool = False  # the head gets an embedding of its own (the target's to start), trained
    # DFlash and DSpark drafters (--family dflash, dspark):
    block_size: int = 16  # tokens a block holds: the root and its masks (DSpark's published blocks: 7)
    anchors: int = 64  # blocks trained per sequence, at random positions redrawn each step
    dflash_layers: int = 5  # the drafter's decoder layers (5 in the published drafters)
    mask_token: Optional[int] = None  # the id filling a block after its root (None: the tokenizer's unknown token)
    markov_rank: int = 256  # DSpark: the Markov head's rank (256 published)

    def __post_init__(self) -> None:
        """One line naming a setting no run could train with."""
        if self.family not in FAMILIES:
            raise UserError(f"family must be one of {', '.join(FAMILIES)}, not {self.family!r}")
        at_least = {"steps": 1, "tokens_per_batch": 1, "grad_accum": 1, "seq_len": 2, "warmup": 0, "ttt_steps": 1,
                    "checkpoint_every": 1, "seed": 0, "pad_multiple": 1, "block_size": 2, "anchors": 1,
                    "dflash_layers": 1, "markov_rank": 1}
        for name, low in at_least.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise UserError(f"{name.replace('_', '-')} must be a whole number, {low} or more, not {value!r}")
        for name in ("lr", "weight_decay", "clip", "step_decay", "feature_noise"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 or \
                    (name == "lr" and value == 0):
                raise UserError(f"{name.replace('_', '-')} must be a finite number, 0 or more"
                                f"{' (above 0)' if name == 'lr' else ''}, not {value!r}")
        if self.block_size > 64 or self.dflash_layers > 64:
            raise UserError(f"block-size and dflash-layers must be 64 or fewer, not {self.block_size} and "
                            f"{self.dflash_layers}")
        if self.mask_outside_draft and not FAMILIES[self.family].draft_vocabulary:
            raise UserError("mask-outside-draft is for drafters with a draft vocabulary of their own ("
                            + ", ".join(f.title for f in FAMILIES.values() if f.draft_vocabulary)
                            + f"), not {FAMILIES[self.family].title}")
        if self.mask_token is not None and (isinstance(self.mask_token, bool) or not isinstance(self.mask_token, int)
                                            or self.mask_token < 0):
            raise UserError(f"mask-token must be a token id, 0 or more, not {self.mask_token!r}")


def learning_rate(config: TrainConfig):
    warmup = max(1, min(config.warmup, config.steps - 1))
    return optim.join_schedules(
        [optim.linear_schedule(config.lr / warmup, config.lr, warmup),
         optim.cosine_decay(config.lr, max(1, config.steps - warmup), config.lr * 0.05)],
        [warmup],
    )


def padded_length(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def epoch_batches(lengths: Sequence[int], config: TrainConfig, epoch: int) -> List[List[int]]:
    """The micro-batches of one epoch, a pure function of (seed, epoch), so a resumed run
    sees exactly the batches an uninterrupted one would. The epoch is shuffled, then cut
    into windows whose pieces are sorted by length and packed by tokens: each micro-batch
    holds as many rows of its padded length as ``tokens_per_batch`` allows, so little of
    it is padding and a long piece does not make a batch larger."""
    rng = np.random.default_rng(config.seed + epoch)
    order = rng.permutation(len(lengths))
    batches = []
    window = max(64, 16 * config.tokens_per_batch // max(1, int(np.mean(lengths))))
    for start in range(0, len(order), window):
        part = sorted(order[start:start + window], key=lambda i: -lengths[i])
        while part:
            rows = max(1, config.tokens_per_batch // padded_length(lengths[part[0]], config.pad_multiple))
            batches.append([int(i) for i in part[:rows]])
            part = part[rows:]
    return [batches[i] for i in rng.permutation(len(batches))]
