"""DFlash block drafters (arXiv 2602.06036; the z-lab checkpoint layout): a few decoder
layers with no embedding or LM head of their own that read the target's states at some
of its layers, fused into one context vector per position, and predict a whole block
[root, mask, ..., mask] in one forward pass: one pass drafts up to ``block_size - 1``
tokens, where an EAGLE head needs one pass per depth.

Each layer's queries come from the block only; its keys and values are those of the
context (projected from the fused states, cached across rounds: the committed tokens'
states never change) followed by the block's own (never cached), and the block attends
to all of them, itself bidirectionally. The block's output at position i is the draft for
the token at root + i. Each round the drafter reads the states the target just committed,
drafts the next block at once, and keeps each position's best few tokens on the device.
From them a round proposes a chain as long as is expected to pay on this device's cost
curve (measured acceptance by position, ChainDrafter), and, where the target verifies
trees, the next-best paths by summed log-probability (DDTree) while each is expected to
pay for its place. Drafts are fixed tokens, so verification keeps the target's text
exactly, greedy or sampled.
"""

from __future__ import annotations

import copy
import heapq
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache

from ..dflash_model import DFlashModel, load, recognizes  # noqa: F401 (the kind's hooks: its checkpoints)
from ..costs import median_ms
from ..target import check_target, keep_cache_entries, lm_head
from ..trees import DraftTree, TreeSpec, parse_tree
from ..trees import chain as chain_paths
from . import Budget, Outcome, Proposal
from .chains import ChainDrafter
from .kinds import DraftSettings, DraftSource

NAME = "dflash"
TOP_K = 4  # tokens kept per block position: the tree's ranks


class DFlashDrafter(ChainDrafter):
    """A DFlash drafter proposing chains (or DDTree trees) from the block it drafted as
    soon as the target committed its last tokens. Where its measured acceptance says no
    draft pays for its verification and the block's own pass, it drafts no block, but one
    in ``PROBE`` rounds."""

    PROBE = 16

    def __init__(self, model: DFlashModel, target: nn.Module, pricing: Callable[[int], float],
                 max_tokens: Optional[int] = None, trees: bool = True, block_cost: float = 0.0):
        """``pricing``: until a round's Budget brings its own; ``trees``: DDTree branches
        beside the chain where the target verifies trees; ``block_cost``: drafting a block,
        in plain decoding steps (``time_block``), which a block must be expected to pay for."""
        drafts = self.drafts_per_block(model.config.block_size)
        super().__init__(pricing, min(drafts, max_tokens or drafts), round_cost=block_cost)
        self.model, self.target, self.trees = model, target, trees
        self.taps = model.config.taps
        self.cache = [KVCache() for _ in model.layers]  # the context's keys and values, committed tokens only
        self.block: Optional[Tuple[mx.array, ...]] = None  # what ``draft`` drafted after the last root
        self.rounds = 0  # outcomes observed
        self._chain = 0  # nodes of the last proposal's chain (the rest are DDTree branches)
        self._layout: List[Tuple[int, ...]] = []  # per proposed node: its rank path

    @staticmethod
    def drafts_per_block(block_size: int) -> int:
        """A block drafts every position after its root."""
        return block_size - 1

    def reusable(self, common: int) -> int:
        return min(self.cache[0].offset, max(common - 1, 0))

    def branch(self) -> "DFlashDrafter":
        twin = self.twin()
        twin.cache, twin.block = copy.deepcopy(self.cache), None
        return twin

    def observe(self, outcome: Outcome) -> None:
        self.observe_together([self], [outcome])

    @classmethod
    def observe_together(cls, drafters: Sequence["DFlashDrafter"], outcomes: Sequence[Outcome]) -> None:
        """Each drafter learns what of its proposal was accepted and reads the states the
        target committed; then each that drafts (where its measured acceptance says nothing
        pays, none does, but one probe in ``PROBE`` rounds) drafts its next block. Those
        sharing one model and target do both together: one pass over every conversation's
        new states, one over all their blocks."""
        groups: Dict[Tuple[int, int], List[Tuple[DFlashDrafter, Outcome]]] = {}
        for drafter, outcome in zip(drafters, outcomes):
            groups.setdefault((id(drafter.model), id(drafter.target)), []).append((drafter, outcome))
        for group in groups.values():
            for drafter, outcome in group:
                if outcome.proposal is not None and len(outcome.proposal):
                    drafter.learn(outcome)
                keep_cache_entries(drafter.cache, outcome.start, [])
            group[0][0].model.read_contexts([(outcome.states.read(drafter.taps), drafter.cache, outcome.start)
                                             for drafter, outcome in group])
            drafting = []
            for drafter, outcome in group:
                drafter.block, drafter.rounds = None, drafter.rounds + 1
                if drafter.best_length(0, drafter.max_tokens, 1, 1.0, drafted=False) or \
                        not drafter.rounds % drafter.PROBE:
                    drafting.append((drafter, outcome.tokens[-1], len(outcome.tokens) - 1))
            if drafting:
                for (drafter, _, _), block in zip(drafting, cls.draft_rows(drafting)):
                    drafter.block = block
                mx.async_eval([part for drafter, _, _ in drafting for part in drafter.block if part is not None])

    def learn(self, outcome: Outcome) -> None:
        """What of this drafter's proposal was accepted: the chain's acceptance by position."""
        taken = sum(1 for node in outcome.path if node < self._chain)
        self.record_chain(0, self._chain, taken)

    @staticmethod
    def draft_rows(drafting: Sequence[Tuple["DFlashDrafter", int, int]]) -> List[Tuple[mx.array, ...]]:
        """The blocks of several conversations sharing one model (drafter, root token, the
        root's position), in one pass: per block position, its best ``TOP_K`` tokens and
        their log-probabilities, best first (on the device)."""
        model, target = drafting[0][0].model, drafting[0][0].target
        states = model.blocks_states(target, [(root_token, drafter.cache, root)
                                              for drafter, root_token, root in drafting])
        logprobs = nn.log_softmax(lm_head(target, states[:, 1:]).astype(mx.float32))
        best = mx.argpartition(-logprobs, kth=TOP_K - 1, axis=-1)[..., :TOP_K]
        best = mx.take_along_axis(best, mx.argsort(-mx.take_along_axis(logprobs, best, axis=-1), axis=-1), axis=-1)
        chosen = mx.take_along_axis(logprobs, best, axis=-1)
        return [(best[row], chosen[row]) for row in range(len(drafting))]

    def propose(self, budget: Budget) -> Optional[Proposal]:
        self.price(budget)
        limit = min(budget.room, budget.nodes, self.max_tokens)
        length = self.best_length(0, limit, budget.verified, budget.expected) if limit >= 1 and self.block else 0
        if not length:
            return None
        top, logprobs = (np.array(part) for part in self.block)
        paths = [(0,) * depth for depth in range(1, length + 1)]
        if self.trees and not budget.chain:
            paths += self.branches(logprobs, length, budget)
        tree = DraftTree()
        index = {(): -1}
        for path in paths:  # parents before children: a path's prefix is already placed
            index[path] = tree.add(int(top[len(path) - 1, path[-1]]), index[path[:-1]])
        self._chain, self._layout = length, paths
        return Proposal(tree, mx.array(tree.tokens, dtype=mx.int32))

    def branches(self, logprobs: np.ndarray, length: int, budget: Budget) -> List[Tuple[int, ...]]:
        """DDTree: beside the chain, rank paths best first by summed log-probability, each
        kept while its probability under the drafter pays for its place in the
        verification on this device's curve; no deeper than the chain."""
        reach = np.cumprod(self.acceptance(0)[:length])
        expected, nodes = budget.expected + reach.sum(), budget.verified + length
        room = min(budget.nodes, 64) - length
        heap = [(-logprobs[0, rank], (rank,)) for rank in range(1, logprobs.shape[1])]
        heap += [(-logprobs[:depth, 0].sum() - logprobs[depth, rank], (0,) * depth + (rank,))
                 for depth in range(1, length) for rank in range(1, logprobs.shape[1])]
        heapq.heapify(heap)
        chosen: List[Tuple[int, ...]] = []
        while heap and len(chosen) < room:
            negative, path = heapq.heappop(heap)
            gain = float(np.exp(-negative))
            if (expected + gain) / self.pricing(nodes + 1) <= expected / self.pricing(nodes):
                break
            chosen.append(path)
            expected, nodes = expected + gain, nodes + 1
            if len(path) < length:
                for rank in range(logprobs.shape[1]):
                    heapq.heappush(heap, (negative - logprobs[len(path), rank], path + (rank,)))
        return chosen


def accepts(draft: object) -> bool:
    return type(draft) is DFlashModel  # (a DSpark model is one too, with heads of its own: drafters/dspark.py)


def source(draft: DFlashModel, model: nn.Module, settings: DraftSettings) -> DraftSource:
    return block_source(draft, model, settings, NAME, lambda pricing, limit, block_cost: DFlashDrafter(
        draft, model, pricing, max_tokens=limit, trees=limit is None, block_cost=block_cost))


def block_source(draft: DFlashModel, model: nn.Module, settings: DraftSettings, kind: str,
                 make: Callable[[Callable[[int], float], Optional[int], float], ChainDrafter]) -> DraftSource:
    """A block drafter's source: ``make(pricing, limit, block_cost)`` makes a conversation's
    drafter, ``limit`` the --tree chain:K cap on its chains (None: any other tree, where
    trees may branch), ``block_cost`` its block's pass in plain steps (timed once here)."""
    check_target(model, draft.config.taps)
    name = f"{kind} {Path(getattr(draft, 'directory', 'drafter')).name}, block {draft.config.block_size}"
    tree = parse_tree(settings.tree) if isinstance(settings.tree, str) and settings.tree != "auto" else settings.tree
    if isinstance(tree, TreeSpec) and tree.kind == "none":
        return DraftSource(name, None, "tree none")
    chain = isinstance(tree, TreeSpec) and tree.kind == "static" and tree.paths == chain_paths(len(tree.paths))
    limit = len(tree.paths) if chain else None
    costs = settings.costs
    pricing = costs.at()
    block_cost = time_block(make(pricing, limit, 0.0)) / costs.plain_ms
    return DraftSource(name + (f", chains of up to {limit}" if chain else ""),
                       lambda: make(pricing, limit, block_cost), f"a block costs {block_cost:.2f} plain steps", draft)


def time_block(drafter: DFlashDrafter, context: int = 64, repeats: int = 3) -> float:
    """Milliseconds ``drafter`` takes to draft a block after ``context`` entries (its pass
    and what it keeps of it), on a fresh drafter of its kind."""
    model = drafter.model
    width = len(model.config.taps) * drafter.target.args.hidden_size
    model.read_context(mx.zeros((context, width), dtype=model.norm.weight.dtype), drafter.cache, 0)
    root = min(100, model.config.vocab_size - 1)
    return median_ms(lambda: mx.eval([part for part in type(drafter).draft_rows([(drafter, root, context)])[0]
                                      if part is not None]), repeats)
