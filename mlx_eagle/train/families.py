"""The kinds of drafter the trainer makes, one record each (as architectures.py has one
per target architecture). A record is plain data, so that --help and the recipe's checks
read it without loading MLX's model code; its code is one module of this package, which
defines:

    new_drafter(target, config, used, init) -> nn.Module
        a drafter shaped for ``target``, in float32, from random weights or from the one
        this trainer wrote at ``init`` (``used``: the draft vocabulary's target ids, or None)
    loss(drafter, target, tokens, mask, features, last, used, key, config)
        -> (loss, per-step losses, per-step accuracies), on the target's states
    save(drafter, path, dtype)
        writes it in the layout its --draft kind loads
    evaluate(target, tokenizer, out, held_out, config, progress) -> (result, line)
        how well the drafter written at ``out`` drafts on the held-out prompts, as a
        JSON-able dict and one line for the terminal

A new trained kind is a record here and its module; nothing else in train/ names a family.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Dict, Optional, Tuple

import numpy as np


@dataclass(frozen=True)
class TrainedFamily:
    name: str  # --family's value, and TrainConfig.family
    title: str  # what help texts and logs call it
    about: str  # what --family's help says of it
    module: str  # mlx_eagle.train.<module>: new_drafter, loss, save, evaluate
    draft_vocabulary: bool = False  # drafts from a vocabulary of its own, the data's most frequent tokens
    settings: Tuple[str, ...] = ()  # the TrainConfig fields only this family reads

    def code(self) -> ModuleType:
        return importlib.import_module(f"{__package__}.{self.module}")


FAMILIES: Dict[str, TrainedFamily] = {family.name: family for family in (
    TrainedFamily("eagle3", "EAGLE-3", "three tapped states, its own draft vocabulary", "eagle3",
                  draft_vocabulary=True, settings=("ttt_steps", "step_decay", "mask_outside_draft")),
    TrainedFamily("eagle1", "EAGLE-1/2", "the last state, the target's LM head", "eagle1"),
    TrainedFamily("dflash", "DFlash", "a block drafter: five tapped states, one pass drafts a block", "dflash",
                  settings=("block_size", "anchors", "dflash_layers", "mask_token")),
    TrainedFamily("dspark", "DSpark", "a block drafter with a Markov head and a confidence head that chooses what "
                  "is verified", "dspark", settings=("block_size", "anchors", "dflash_layers", "mask_token",
                                                     "markov_rank")),
)}


def drafter_to_train(target, config, used: Optional[np.ndarray] = None, init: Optional[Path] = None):
    """A new drafter of ``config.family`` for training (see the module's docstring)."""
    return FAMILIES[config.family].code().new_drafter(target, config, used, init)
