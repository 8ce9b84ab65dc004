"""Which drafted nodes a batch's packed pass verifies: its (row, node) pairs ranked
together, not seat by seat.

Each conversation in a batched round drafts up to its own cap, priced as if the others
verified only their roots. The round then asks of the whole pass the question a single
conversation's budget asks of its own round (drafters/admit.py): taking nodes in order of
their chance of acceptance, across every row, how many give the most expected tokens per
millisecond of the pass? A node's chance is the product of its path's conditional
chances: the drafter's confidences where it gives them, otherwise what this conversation
saw accepted at the node's depth and rank among its siblings (``NodeOdds``), starting from
what its plan's conversations saw (an agent's new turn is a new conversation, whose drafts
from its earlier turns are as sure as theirs were). Where no node pays, the pass verifies
the roots alone: plain batching.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from .trees import DraftTree

# Depths and sibling ranks told apart; deeper or later ones share the last.
DEPTHS = 32
RANKS = 16
# A plan's odds, which its conversations' own start from, weigh about its last 50 trees:
# each tree recorded multiplies the older ones' weight by this.
PLAN_DECAY = 0.98


def slots(tree: DraftTree) -> List[Tuple[int, int]]:
    """Each node's (depth - 1, rank among its siblings in node order), clipped to the table."""
    seen: dict = {}
    found = []
    for parent, depth in zip(tree.parents, tree.depths):
        rank = seen.get(parent, 0)
        seen[parent] = rank + 1
        found.append((min(depth, DEPTHS) - 1, min(rank, RANKS - 1)))
    return found


class NodeOdds:
    """A conversation's acceptance by (depth, sibling rank): of the nodes verified whose
    parent was accepted, the share accepted. Each estimate is shrunk towards a prior by
    ``PRIOR_WEIGHT`` pseudo-observations: the same rank one depth up, or (first depth) half
    the rank before (the first: ``PRIOR_RATE``), as chains.ChainDrafter starts deep
    positions from shallow ones."""

    PRIOR_RATE = 0.5
    PRIOR_WEIGHT = 2.0

    def __init__(self, prior: Optional["NodeOdds"] = None, decay: float = 1.0):
        """``prior``: the odds a new conversation starts from (every conversation's of one
        plan, recent ones weighing most: ``decay`` per tree recorded), which also learn what
        this one records. None: the chain of PRIOR_RATE above."""
        self.tried = np.zeros((DEPTHS, RANKS))
        self.accepted = np.zeros((DEPTHS, RANKS))
        self.prior, self.decay = prior, decay
        self._rates: Optional[np.ndarray] = None

    def record(self, node_slots: Sequence[Tuple[int, int]], parents: Sequence[int], path: Sequence[int]) -> None:
        """A verified tree (its nodes' slots and parents) and its accepted ``path``."""
        if self.prior is not None:
            self.prior.record(node_slots, parents, path)
        if self.decay < 1.0:
            self.tried *= self.decay
            self.accepted *= self.decay
        on_path = set(path)
        for node, ((depth, rank), parent) in enumerate(zip(node_slots, parents)):
            if parent < 0 or parent in on_path:
                self.tried[depth, rank] += 1
                self.accepted[depth, rank] += node in on_path
        self._rates = None

    def rates(self) -> np.ndarray:
        """P(accepted | parent accepted), [DEPTHS, RANKS]."""
        if self.prior is not None:  # (not kept: the prior learns from the others too)
            return (self.accepted + self.PRIOR_WEIGHT * self.prior.rates()) / (self.tried + self.PRIOR_WEIGHT)
        if self._rates is None:
            rates = np.empty((DEPTHS, RANKS))
            first = np.empty(RANKS)
            prior = self.PRIOR_RATE
            for rank in range(RANKS):
                first[rank] = prior = ((self.accepted[0, rank] + self.PRIOR_WEIGHT * prior)
                                       / (self.tried[0, rank] + self.PRIOR_WEIGHT))
                prior *= 0.5
            rates[0] = first
            for depth in range(1, DEPTHS):
                rates[depth] = ((self.accepted[depth] + self.PRIOR_WEIGHT * rates[depth - 1])
                                / (self.tried[depth] + self.PRIOR_WEIGHT))
            self._rates = rates
        return self._rates

    def chances(self, tree: DraftTree, node_slots: Sequence[Tuple[int, int]],
                confidence: Optional[Sequence[float]] = None) -> List[float]:
        """Each node's chance of acceptance: its path's product of the drafter's
        ``confidence`` where given, of this conversation's rates otherwise."""
        if confidence is None:
            rates = self.rates()
            confidence = [rates[depth, rank] for depth, rank in node_slots]
        chance: List[float] = []
        for node, parent in enumerate(tree.parents):
            chance.append(float(confidence[node]) * (chance[parent] if parent >= 0 else 1.0))
        return chance


def choose_across(chances: Sequence[Sequence[float]], verified: int, cost: Callable[[int], float]) -> List[List[int]]:
    """The nodes of each row to verify: (row, node) pairs taken by chance, most likely
    first (a parent before its child; seat order only among equals), as many as give the
    most expected tokens per unit of ``cost(tokens)``, the pass over ``verified`` tokens
    (roots and unread tokens) and the nodes taken; each row's in node order. Each row's
    root yields a token whatever is drafted."""
    pairs = sorted((-chance, row, node) for row, row_chances in enumerate(chances)
                   for node, chance in enumerate(row_chances))
    expected = float(len(chances))
    best, best_value = 0, expected / cost(verified)
    for count, (negative, _, _) in enumerate(pairs, 1):
        expected -= negative
        value = expected / cost(verified + count)
        if value > best_value:
            best, best_value = count, value
    kept: List[List[int]] = [[] for _ in chances]
    for _, row, node in pairs[:best]:
        kept[row].append(node)
    return [sorted(nodes) for nodes in kept]
