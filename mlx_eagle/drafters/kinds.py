"""The registry of the built-in drafter kinds: what each kind module defines, and what
the plan (plan.py) tells a kind when it makes its source. The ``Drafter`` protocol itself
(__init__.py) knows none of this, so a drafter of your own needs none of the engine."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, List, Optional, Union

import mlx.nn as nn

from ..costs import Costs, verify_costs
from ..target import KVQuantization
from ..trees import TreeSpec
from . import Drafter
from .history import History

# The kinds of drafter, one module each: mlx_eagle.drafters.<kind>. A kind module defines
#   NAME                         what the drafts: line calls it
#   recognizes(path, config) -> bool   whether a --draft path holds this kind (config: its
#                                config.json, None for a file)
#   load(directory, model)       its weights for ``model``, as load_draft returns them
#   accepts(draft) -> bool       whether a loaded draft (or an object the API is handed) is this kind's
#   source(draft, model, settings) -> DraftSource   the drafter factory the plan keeps
# The first that recognizes a path (or accepts a loaded draft, or ships for a model) takes it.
KINDS = ("dspark", "dflash", "mtp", "eagle", "draft_model", "lookup")


def kind_modules() -> List[ModuleType]:
    return [importlib.import_module(f"{__package__}.{kind}") for kind in KINDS]


@dataclass
class DraftSettings:
    """What the plan tells a kind when it makes its source."""

    model: nn.Module  # the target
    tree: Union[str, TreeSpec, None] = "auto"  # the tree a head or a tree-drafting kind grows
    history: Optional[History] = None  # earlier replies to draft from (drafters/history.py)
    kv: Optional[KVQuantization] = None  # the target's quantized KV caches, which verification attends over

    @property
    def costs(self) -> Costs:
        """This device's verify-cost curves for the target and its KV caches (timed once, then cached)."""
        return verify_costs(self.model, self.kv)


@dataclass
class DraftSource:
    """One source of drafts in a plan: what it is called, and how to make a fresh
    drafter for each conversation (None: it decided not to draft here, for ``note``)."""

    name: str
    make: Optional[Callable[[], Drafter]]
    note: Optional[str] = None  # why it drafts the way it does (a tree's calibration, ...)
    draft: object = None  # what it drafts with (a head), for reports
