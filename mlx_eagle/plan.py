"""What drafts, decided once: the ``DraftPlan`` and the one policy that makes it.

Every entry point (the API, the commands, ``Engine``/``ChatSession``, the server, bench
and tune) turns its draft choice into a plan with ``plan_drafts`` when the model and its
drafters are loaded, and hands the plan on; ``stream_generate`` makes one itself when
given a head, a drafter or a word.

The draft choice (``--draft``, ``draft=``):
  "auto"     the model's own drafter where there is one (its MTP module, a head shipped
             for it: the one with the higher recorded acceptance), and drafts from the context
  "lookup"   drafts from the context alone (any model mlx-lm loads), as None does
  "none"     plain decoding through the same loop
  a path     a drafter's directory; each kind in drafters.KINDS says whether it is its own
  an object  a loaded head (load_draft), or your own ``Drafter``
Drafts from the context join every choice but "none" unless ``lookup=False``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional, Tuple, Union

import mlx.nn as nn
import numpy as np

from .drafters import Drafter, DraftSettings, DraftSource, kind_modules
from .drafters.composite import Composite
from .errors import UserError, did_you_mean, read_config
from .trees import TreeSpec

if TYPE_CHECKING:
    from .drafters.history import History

WORDS = ("auto", "lookup", "none")


@dataclass
class DraftPlan:
    """The drafters for one model: each source in the order it drafts (those that decided
    not to draft here say why in ``note``), and the settings they were made with."""

    sources: List[DraftSource]
    settings: DraftSettings
    key: Tuple = field(default=())  # what the plan was made from: equal keys, equal plans

    @property
    def active(self) -> List[DraftSource]:
        return [source for source in self.sources if source.make is not None]

    @property
    def notes(self) -> List[str]:
        return [source.note for source in self.sources if source.note]

    @property
    def head(self):
        """The EAGLE head drafting in this plan, if any."""
        return next((s.draft for s in self.active if s.draft is not None), None)

    def describe(self) -> str:
        """What drafts, in words: the drafts: line."""
        return " + ".join(source.name for source in self.active) or "none (plain decoding)"

    def drafter(self) -> Optional[Drafter]:
        """Fresh drafters for one conversation, merged where there are several; None: plain
        decoding."""
        made = [source.make() for source in self.active]
        if not made:
            return None
        return made[0] if len(made) == 1 else Composite(made)


def _kind(name: str):
    return next(kind for kind in kind_modules() if kind.NAME == name)


def drafter_kind(path: Path, config: Optional[dict]) -> Optional[str]:
    """The name of the first drafter kind that recognizes ``path`` (None: none does)."""
    return next((kind.NAME for kind in kind_modules() if kind.recognizes(path, config)), None)


def path_kind(path: Path):
    """The kind whose drafter ``path`` (a directory, or a file such as a GGUF) holds, or one
    line saying what it looks like."""
    config = read_config(path, "a drafter's directory (an EAGLE head, a draft model, ...)") if path.is_dir() else None
    for kind in kind_modules():
        if kind.recognizes(path, config):
            return kind
    kinds = ", ".join(k.NAME for k in kind_modules())
    if config is None:
        raise UserError(f"draft {path} is a file that no drafter kind reads ({kinds}); pass a drafter's directory "
                        "or a .gguf model")
    layers, model_type = config.get("num_hidden_layers"), config.get("model_type")
    looks = f"a {model_type} model with {layers} layers and no tokenizer" if model_type and layers else \
        "no drafter this runtime knows"
    raise UserError(f"{path} looks like {looks}, not a drafter ({kinds})")


def best_shipped(drafters: List[object]) -> Optional[object]:
    """Of the drafters that come with a model (its own MTP module, a head shipped for it),
    the one whose recorded acceptance promises the longest chains (tokens per round on a
    chain of its recorded depth); the first on a tie, in KINDS order (the model's own first)."""
    from .calibrate import head_acceptance

    def chain_tokens(drafter: object) -> float:
        return 1.0 + float(np.cumprod(head_acceptance(drafter)[0][:, 0]).sum())

    return max(drafters, key=chain_tokens, default=None)


def load_draft(draft: Union[str, Path, None, object], model: nn.Module):
    """What ``draft`` drafts with, loaded for ``model``: a drafter's directory loaded by its
    kind, "auto" the drafter shipped for this model (None if there is none), and None for
    "none", "lookup" and None. Anything else is returned as it is."""
    if draft is None or draft in ("none", "lookup"):
        return None
    if draft == "auto":
        return best_shipped([found for kind in kind_modules() if hasattr(kind, "shipped")
                             for found in [kind.shipped(model)] if found is not None])
    if isinstance(draft, (str, Path)):
        path = Path(draft).expanduser()
        if not path.exists() and isinstance(draft, str) and draft.count("/") == 1 and not draft.startswith((".", "~")):
            from .hub import from_hub  # a Hugging Face repo id: a head or a draft model, fetched when online

            path = from_hub(draft)
        if not path.exists():
            raise UserError(f"draft {draft} does not exist{did_you_mean(str(draft), WORDS)}; pass a drafter's "
                            f"directory, or one of {', '.join(WORDS)}")
        return path_kind(path).load(path, model)
    return draft


def history_of(model: nn.Module, history: Union[bool, str, Path, "History", None], key: str = ""):
    """The earlier replies to draft from: True, this process's for ``model`` (and ``key``,
    the server's model id); a path, the file's (loaded and saved); False or None, none."""
    from .drafters.history import History, for_model, model_identity

    if history is None or history is False:
        return None
    if history is True:
        return for_model(model, key)
    if isinstance(history, History):
        return history
    return History.open(Path(history), model_identity(model))


def plan_drafts(model: nn.Module, draft: Union[str, Path, None, object] = "auto",
                tree: Union[str, TreeSpec, None] = "auto", lookup: bool = True,
                history: Union[bool, str, Path, object, None] = True) -> DraftPlan:
    """The one policy: what drafts for ``model`` given the user's draft choice (see the
    module's docstring), the head's ``tree``, whether to draft from the context, and from
    which ``history`` of earlier replies (see ``history_of``)."""
    if isinstance(draft, DraftPlan):
        return draft
    if draft == "none":
        lookup = False
    history = history_of(model, history) if lookup else None
    key = (id(model), draft if isinstance(draft, (str, Path, type(None))) else id(draft),
           tree.text if isinstance(tree, TreeSpec) else tree, lookup, id(history))
    loaded = load_draft(draft, model)
    settings = DraftSettings(model, tree, history)
    sources = []
    if isinstance(loaded, Drafter):
        sources.append(DraftSource(type(loaded).__name__, lambda: loaded))
    elif loaded is not None:
        kind = next((k for k in kind_modules() if k.accepts(loaded)), None)
        if kind is None:
            raise UserError(f"draft {loaded!r}: pass a head (mlx_eagle.load_draft), a Drafter, or one of "
                            f"{', '.join(WORDS)}")
        sources.append(kind.source(loaded, model, settings))
    if lookup:
        sources.append(_kind("lookup").source("lookup", model, settings))
    return DraftPlan(sources, settings, key)

