"""A small model with the target's tokenizer as the drafter: mlx-lm's --draft-model,
behind the seam, so that it merges with the other drafters and sizes its chain each round.

Each round the draft model reads what was committed since its cache last agreed with
the target (its cache is cut back to the accepted prefix, as a KV cache can be), then
drafts greedily, one token per forward, as many tokens as are expected to pay off: the
chain's measured acceptance by position against what verifying it costs on this device
plus what drafting it costs (a draft step, timed once, in target steps). Drafts are the
draft model's argmax, so verification (greedy, or rejection sampling with q = 1) keeps
the output exactly the target's.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from ..errors import UserError
from . import Budget, DraftSettings, DraftSource, Outcome, Proposal
from .chains import ChainDrafter

NAME = "draft model"
PREFILL_CHUNK = 512


@dataclass
class DraftModel:
    """A loaded draft model: the model, and where it came from (for the drafts: line)."""

    model: nn.Module
    name: str = "draft model"


def _common(a: List[int], b: List[int]) -> int:
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


class DraftModelDrafter(ChainDrafter):
    """Chains drafted by ``model``. Kinds of draft (ChainDrafter): whether the last
    round's chain was accepted whole."""

    def __init__(self, model: nn.Module, cost, step_cost: float, max_tokens: int = 16):
        super().__init__(cost, max_tokens, kinds=2, step_cost=step_cost)
        self.model = model
        self.cache = make_prompt_cache(model)
        self.held: List[int] = []  # the tokens the draft cache holds, in order
        self.committed: List[int] = []  # what the target committed, the root last
        self.whole = False  # the last chain was accepted whole
        self._kind = 0

    def _read(self, tokens: List[int]) -> Optional[mx.array]:
        """Bring the cache to hold ``tokens``: cut it back to where it agrees with them, then
        read the rest; the logits after the last token read (None if none was)."""
        common = _common(self.held, tokens)
        trim_prompt_cache(self.cache, len(self.held) - common)
        self.held = list(tokens)
        logits = None
        for start in range(common, len(tokens), PREFILL_CHUNK):
            logits = self.model(mx.array([tokens[start:start + PREFILL_CHUNK]]), cache=self.cache)[0, -1]
        return logits

    def observe(self, outcome: Outcome) -> None:
        if outcome.proposal is not None and len(outcome.proposal):
            proposed = outcome.proposal.host_tokens()
            self.record_chain(self._kind, len(proposed), outcome.accepted)
            self.whole = outcome.accepted == len(proposed)
            self.held = self.committed + proposed[:-1]  # what drafting left in the cache
        self.committed = list(outcome.tokens)
        if outcome.from_prompt:  # read the prompt now, as the target just did, not in the first round
            self._read(self.committed[:-1])
            mx.eval([c.state for c in self.cache])

    def propose(self, budget: Budget) -> Optional[Proposal]:
        self._kind, self.whole = int(self.whole), False
        limit = min(budget.room, budget.nodes, self.max_tokens)
        length = self.best_length(self._kind, limit, budget.verified, budget.expected) if limit >= 1 else 0
        if not length:
            return None
        logits = self._read(self.committed)
        if logits is None:  # nothing new since the last round: cannot happen between observes
            return None
        token = mx.argmax(logits)  # the root's successor
        drafted = [token]
        for _ in range(length - 1):
            token = mx.argmax(self.model(token.reshape(1, 1), cache=self.cache)[0, -1])
            drafted.append(token)
        tokens = mx.stack(drafted)
        mx.async_eval(tokens)
        return Proposal.chain(tokens)


def recognizes(path: Path, config: Optional[dict]) -> bool:
    """A model mlx-lm (or the converter) loads: a .gguf file, or a model directory with a
    tokenizer and more than one layer."""
    if config is None:
        return path.suffix == ".gguf"
    tokenizers = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    has_tokenizer = any((path / name).exists() for name in tokenizers)
    return "model_type" in config and has_tokenizer and config.get("num_hidden_layers") != 1


def load(path: Path, model: nn.Module) -> DraftModel:
    from ..models import load_target

    draft, _, _ = load_target(str(path))
    return DraftModel(draft, Path(path).name)


def accepts(draft: Any) -> bool:
    return isinstance(draft, DraftModel) or (isinstance(draft, nn.Module)
                                             and hasattr(getattr(draft, "args", None), "vocab_size"))


_STEP_COSTS = {}  # (draft model, target) ids -> a draft step in target steps, timed once per process


def step_cost(draft: nn.Module, target: nn.Module, settings: DraftSettings) -> float:
    """One draft token (a forward over one token after a few hundred cached) in target steps."""
    from ..costs import time_forwards

    key = (id(draft), id(target))
    if key not in _STEP_COSTS:
        _STEP_COSTS[key] = time_forwards(draft, sizes=(1,), repeats=3)[1] / settings.costs.verify(1)
    return _STEP_COSTS[key]


def source(draft: Any, model: nn.Module, settings: DraftSettings) -> DraftSource:
    loaded = draft if isinstance(draft, DraftModel) else DraftModel(draft)
    vocab, wanted = loaded.model.args.vocab_size, model.args.vocab_size
    if vocab != wanted:
        raise UserError(f"the draft model {loaded.name} has a vocabulary of {vocab}, the target {wanted}: a draft "
                        "model must share the target's tokenizer")
    if not can_trim_prompt_cache(make_prompt_cache(loaded.model)):
        raise UserError(f"the draft model {loaded.name}'s cache cannot be rewound; pick an attention model")
    costs = settings.costs
    cost = step_cost(loaded.model, model, settings)
    note = f"a draft step costs {cost:.2f} target steps here"
    if cost >= 1.0:
        print(f"warning: {loaded.name} drafts slower than the target decodes ({note}): it will rarely draft",
              file=sys.stderr)
    return DraftSource(f"draft model {loaded.name}", lambda: DraftModelDrafter(loaded.model, costs, cost), note)
