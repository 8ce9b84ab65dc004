"""A small model with the target's tokenizer as the drafter: mlx-lm's --draft-model,
behind the seam, so that it merges with the other drafters and sizes its chain each round.

As each round's outcome comes, the draft model reads what was committed since its cache
last agreed with the target (its cache is cut back to the accepted prefix, as a KV cache
can be; a hybrid draft model's recurrent state goes back to the snapshot taken at that
length, since it drafts one token per forward and a snapshot is free: rewind.py), then
drafts the next round's chain ahead, greedily, one token per forward, as many tokens as are
expected to pay off: the chain's measured acceptance by position against what verifying it
costs on this device plus what drafting it costs (a draft step, timed once, in target
steps); the round's own budget then cuts it. In a batch, the conversations drafting with
one draft model read and draft together: one packed pass a depth over all of them
(observe_together). Beside each chain
token its runner-up (the draft model's second choice at that depth, from the same forward)
may stand as a leaf, where it is expected to pay for its place in the verification: its
measured acceptance where the chain token was refused, against the cost curve (on a CPU,
where each verified token costs, rarely; on a flat curve, often). Drafts are fixed tokens,
so verification (greedy, or rejection sampling over the tree) keeps the output exactly
the target's.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from ..costs import time_forwards
from ..errors import UserError
from ..models import load_target
from ..rewind import Rewind
from ..target import Block, packed_forward, packs
from ..trees import DraftTree
from . import Budget, Outcome, Proposal, common_prefix
from .chains import ChainDrafter
from .kinds import DraftSettings, DraftSource

NAME = "draft model"
PREFILL_CHUNK = 512


@dataclass
class DraftModel:
    """A loaded draft model: the model, and where it came from (for the drafts: line)."""

    model: nn.Module
    name: str = "draft model"


class DraftModelDrafter(ChainDrafter):
    """Chains drafted by ``model``, with runner-up leaves where they pay. Kinds of draft
    (ChainDrafter): whether the last round's chain was accepted whole."""

    RUNNER_UP_PRIOR = 0.2  # P(runner-up accepted | chain token refused) before any is seen
    RUNNER_UP_WEIGHT = 2.0

    def __init__(self, model: nn.Module, pricing: Callable[[int], float], step_cost: float, max_tokens: int = 16):
        super().__init__(pricing, max_tokens, kinds=2, step_cost=step_cost)
        self.model = model
        self.cache = make_prompt_cache(model)
        # A recurrent state cannot be cut back: snapshots of the caches by how many tokens they held.
        self.rewind = None if can_trim_prompt_cache(self.cache) else Rewind(model, self.cache, replay=False)
        self.snapshots: Dict[int, Any] = {0: self.rewind.snapshot()} if self.rewind else {}
        self.held: List[int] = []  # the tokens the draft cache holds, in order (but a chain drafted ahead: holding())
        self.committed: List[int] = []  # what the target committed, the root last
        # The next round's chain, drafted ahead when the last round's outcome came, and each
        # depth's runner-up, on the device (None: none drafted; propose cuts it to the budget).
        self.queued: Optional[Tuple[mx.array, mx.array]] = None
        self._kind = 0  # this round's kind of draft: whether the last chain was accepted whole
        self._layout: List[Tuple[int, bool]] = []  # per proposed node: (depth, is a runner-up)
        self.runner_up_tried = np.zeros(max_tokens)  # by depth: chain token refused, a runner-up there
        self.runner_up_taken = np.zeros(max_tokens)  # ... and the runner-up accepted

    def branch(self) -> Optional["DraftModelDrafter"]:
        if self.rewind is not None:  # (a recurrent draft model: fresh, reading the prompt again)
            return None
        twin = self.twin()
        twin.cache, twin.held, twin.committed = copy.deepcopy(self.cache), list(self.holding()), list(self.committed)
        twin.runner_up_tried, twin.runner_up_taken = self.runner_up_tried.copy(), self.runner_up_taken.copy()
        return twin

    def holding(self) -> List[int]:
        """The tokens the draft cache holds, in order (a chain drafted ahead read to the host)."""
        if self.queued is not None:
            self.held, self.queued = self.committed + self.queued[0].tolist()[:-1], None
        return self.held

    def _unread(self, tokens: List[int]) -> List[int]:
        """Bring the cache towards holding ``tokens``: cut it back to where it agrees with
        them, then read all but the last PREFILL_CHUNK of the rest; returns what is left to
        read: at least the last token, whose logits the next draft begins from."""
        common = min(common_prefix(self.holding(), tokens), len(tokens) - 1)
        if self.rewind is None:
            trim_prompt_cache(self.cache, len(self.held) - common)
        else:
            common = max(length for length in self.snapshots if length <= common)
            self.rewind.restore(self.snapshots[common])
            self.snapshots = {0: self.snapshots[0]}
        self.held = list(tokens)
        while len(tokens) - common > PREFILL_CHUNK:
            self.model(mx.array([tokens[common:common + PREFILL_CHUNK]]), cache=self.cache)
            common += PREFILL_CHUNK
        return tokens[common:]

    def _read(self, tokens: List[int]) -> Optional[mx.array]:
        """Bring the cache to hold ``tokens``; the logits after the last token read (None if
        none was)."""
        rest = self._unread(tokens)
        logits = self.model(mx.array([rest]), cache=self.cache)[0, -1] if rest else None
        self._snapshot(len(tokens))
        return logits

    def _snapshot(self, length: int) -> None:
        """Where the cache is recurrent: what it holds now, ``length`` tokens."""
        if self.rewind is not None:
            self.snapshots[length] = self.rewind.snapshot()

    def _learn(self, outcome: Outcome) -> int:
        """The bookkeeping of ``observe``: the chain's yield counted, the prompt read where the
        outcome is the prompt's; returns the length of the chain to draft ahead for the next
        round (alone in its block, at this conversation's last prices: ``propose`` cuts it
        to the round's budget)."""
        self.holding()
        whole = False
        if outcome.proposal is not None and len(outcome.proposal):
            chain = sum(1 for _, runner_up in self._layout if not runner_up)
            taken = sum(1 for i in outcome.path if not self._layout[i][1])  # chain tokens accepted
            self.record_chain(self._kind, chain, taken)
            whole = taken == chain
            if any(depth == taken + 1 and runner_up for depth, runner_up in self._layout):
                self.runner_up_tried[taken] += 1
                self.runner_up_taken[taken] += bool(outcome.path) and self._layout[outcome.path[-1]][1]
        self._kind = int(whole)
        self.committed = list(outcome.tokens)
        if outcome.from_prompt:  # read the prompt now, as the target just did, not in the first round
            self._read(self.committed[:-1])
            mx.eval([c.state for c in self.cache])
        return self.best_length(self._kind, self.max_tokens, 1, 1.0)

    def observe(self, outcome: Outcome) -> None:
        """Learn the outcome and draft the next round's chain ahead, queued on the device."""
        self._draft_ahead(self._learn(outcome))

    def _draft_ahead(self, length: int) -> None:
        """Read what was committed and draft a ``length``-token chain from it, alone."""
        logits = self._read(self.committed) if length else None
        if logits is not None:
            _draft_chains([self], [logits], [length])

    @classmethod
    def observe_together(cls, drafters: Sequence["DraftModelDrafter"], outcomes: Sequence[Outcome]) -> None:
        """Each drafter learns its outcome; those sharing one draft model that packs (no
        recurrent layers) read what was committed and draft their next chains together: one
        packed pass of the draft model for every conversation's reads, then one a depth
        (target.packed_forward: each conversation's own cache and positions)."""
        groups: Dict[int, List[Tuple["DraftModelDrafter", int]]] = {}
        for drafter, outcome in zip(drafters, outcomes):
            length = drafter._learn(outcome)
            if length:
                key = id(drafter.model) if drafter.rewind is None and packs(drafter.model) else id(drafter)
                groups.setdefault(key, []).append((drafter, length))
        for group in groups.values():
            if len(group) == 1:
                group[0][0]._draft_ahead(group[0][1])
                continue
            rests = [(drafter, length, drafter._unread(drafter.committed)) for drafter, length in group]
            rests = [(drafter, length, rest) for drafter, length, rest in rests if rest]
            outs = packed_forward(rests[0][0].model, [
                Block(mx.array(rest), drafter.cache, drafter.cache[0].offset, "causal" if len(rest) > 1 else None)
                for drafter, _, rest in rests]) if rests else []
            _draft_chains([d for d, _, _ in rests], [out.logits[-1] for out in outs], [n for _, n, _ in rests])

    def propose(self, budget: Budget) -> Optional[Proposal]:
        self.price(budget)
        if self.queued is None:  # none drafted ahead: none expected to pay
            return None
        chain, runners_up = self.queued
        limit = min(budget.room, budget.nodes, chain.size)
        length = self.best_length(self._kind, limit, budget.verified, budget.expected) if limit >= 1 else 0
        if not length:
            return None
        leaves = set() if budget.chain else \
            self.runner_up_depths(length, min(budget.nodes, self.max_tokens) - length, budget)
        tree, chain_node, picked = DraftTree(), -1, []
        self._layout = []
        for depth in range(1, length + 1):
            parent, chain_node = chain_node, tree.add(0, chain_node)
            picked.append(depth - 1)
            self._layout.append((depth, False))
            if depth in leaves:  # the runner-up, a leaf beside the chain token
                tree.add(0, parent)
                picked.append(chain.size + depth - 1)
                self._layout.append((depth, True))
        tree.tokens = []  # on the device until read
        return Proposal(tree, mx.concatenate([chain, runners_up])[mx.array(picked)])

    def runner_up_depths(self, length: int, room: int, budget: Budget) -> set:
        """The depths whose runner-up is expected to pay for its place beside a ``length``
        chain: best first, while the round's expected tokens per unit of verify cost grow."""
        rates = self.acceptance(self._kind)[:length]
        chain = np.cumprod(rates)
        reach = np.concatenate([[1.0], chain[:-1]])  # the chain token at depth d is reached
        taken = ((self.runner_up_taken[:length] + self.RUNNER_UP_WEIGHT * self.RUNNER_UP_PRIOR)
                 / (self.runner_up_tried[:length] + self.RUNNER_UP_WEIGHT))
        gains = reach * (1 - rates) * taken
        expected, nodes, chosen = budget.expected + chain.sum(), budget.verified + length, set()
        for depth in np.argsort(-gains)[:max(room, 0)]:
            value = (expected + gains[depth]) / (self.pricing(nodes + 1) + self.step_cost * length)
            if value <= expected / (self.pricing(nodes) + self.step_cost * length):
                break
            expected, nodes = expected + gains[depth], nodes + 1
            chosen.add(int(depth) + 1)
        return chosen


def _draft_chains(drafters: Sequence[DraftModelDrafter], logits: List[mx.array], lengths: Sequence[int]) -> None:
    """Each drafter's next chain, ``lengths`` tokens greedily from ``logits`` (its model's
    after what it read), queued with each depth's runner-up: one forward a depth for every
    drafter still drafting, packed where several are (one draft model, each its own cache)."""
    chains: List[List[mx.array]] = [[] for _ in drafters]
    runners_up: List[List[mx.array]] = [[] for _ in drafters]
    for depth in range(1, max(lengths, default=0) + 1):
        rows = [row for row, length in enumerate(lengths) if length >= depth]
        if depth > 1 and len(rows) == 1:  # the draft model reads the chain token before
            drafter = drafters[rows[0]]
            logits[rows[0]] = drafter.model(chains[rows[0]][-1].reshape(1, 1), cache=drafter.cache)[0, -1]
            drafter._snapshot(len(drafter.committed) + depth - 1)
        elif depth > 1:
            outs = packed_forward(drafters[rows[0]].model, [
                Block(chains[row][-1].reshape(1), drafters[row].cache, drafters[row].cache[0].offset, None)
                for row in rows])
            for row, out in zip(rows, outs):
                logits[row] = out.logits[-1]
        for row in rows:
            token = mx.argmax(logits[row])
            chains[row].append(token)
            runners_up[row].append(mx.argmax(mx.where(mx.arange(logits[row].shape[-1]) == token, -mx.inf, logits[row])))
    for drafter, chain, runner_up in zip(drafters, chains, runners_up):
        drafter.queued = (mx.stack(chain).astype(mx.int32), mx.stack(runner_up).astype(mx.int32))
    mx.async_eval([array for drafter in drafters for array in drafter.queued])


def recognizes(path: Path, config: Optional[dict]) -> bool:
    """A model mlx-lm (or the converter) loads: a .gguf file, or a model directory with a
    tokenizer and more than one layer."""
    if config is None:
        return path.suffix == ".gguf"
    tokenizers = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    has_tokenizer = any((path / name).exists() for name in tokenizers)
    return "model_type" in config and has_tokenizer and config.get("num_hidden_layers") != 1


def load(path: Path, model: nn.Module) -> DraftModel:

    draft, _, _ = load_target(str(path), shard=False)  # small: every rank of a sharded target runs all of it
    return DraftModel(draft, Path(path).name)


def accepts(draft: Any) -> bool:
    return isinstance(draft, DraftModel) or (isinstance(draft, nn.Module)
                                             and hasattr(getattr(draft, "args", None), "vocab_size"))


_STEP_COSTS = {}  # (draft model, target) ids -> a draft step in target steps, timed once per process


def step_cost(draft: nn.Module, target: nn.Module, settings: DraftSettings) -> float:
    """One draft token (a forward over one token after a few hundred cached) in target steps."""

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
    pricing = settings.costs.at()
    cost = step_cost(loaded.model, model, settings)
    note = f"a draft step costs {cost:.2f} target steps here"
    if cost >= 1.0:
        print(f"warning: {loaded.name} drafts slower than the target decodes ({note}): it will rarely draft",
              file=sys.stderr)
    return DraftSource(f"draft model {loaded.name}", lambda: DraftModelDrafter(loaded.model, pricing, cost), note)
