"""A model's own multi-token-prediction module (mtp_model.py) as its drafter: found in the
model's checkpoint files (``--draft auto``), never passed as ``--draft``; it drafts chains
(trees where target.py drives the target) as an EAGLE-1 head does, through EagleDrafter."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import mlx.nn as nn

from ..errors import UserError
from ..heads import read_safetensors
from ..mtp_model import MODEL_TYPES, MTPModule, module_for
from . import eagle
from .kinds import DraftSettings, DraftSource

NAME = "mtp"


def recognizes(path: Path, config: Optional[dict]) -> bool:
    return False  # it comes with the model, never as --draft


def load(directory: Path, model: nn.Module):
    raise UserError(f"{directory}: an MTP module is read from the model's own checkpoint; pass --draft auto")


def accepts(draft: object) -> bool:
    return isinstance(draft, MTPModule)


def shipped(model: nn.Module) -> Optional[MTPModule]:
    """The MTP module in the model's own checkpoint files, if they hold one."""
    directory = getattr(model, "directory", None)
    if directory is None or getattr(model.args, "model_type", None) not in MODEL_TYPES:
        return None

    module = module_for(model, read_safetensors(directory), directory)
    if module is not None:
        module.directory = Path(directory)
    return module


def source(draft: MTPModule, model: nn.Module, settings: DraftSettings) -> DraftSource:
    """The module drafting chains, as an EAGLE head does (eagle.source), named for what it is."""

    made = eagle.source(draft, model, settings)
    return DraftSource(made.name.replace("mtp head", "the model's MTP module"), made.make, made.note, draft)
