"""Which drafted nodes a batch's packed pass verifies: its (row, node) pairs ranked
together, not seat by seat.

Each conversation in a batched round drafts up to its own cap, priced as if the others
verified only their roots. The round then asks of the whole pass the question a single
conversation's budget asks of its own round (drafters/admit.py): taking nodes in order of
their chance of acceptance, across every row, how many give the most expected tokens per
millisecond of the pass? A node's chance is the product of its path's conditional
chances: the drafter's confidences where it gives them, otherwise what this conversation
saw accepted at the node's depth and rank among its siblings (``NodeOdds``). Where no node
pays, the pass verifies the roots alone: plain batching.
"""

from __future__ import annotations

import weakref
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .trees import DraftTree

# Depths and sibling ranks told apart; deeper or later ones share the last.
DEPTHS = 32
RANKS = 16


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

    def __init__(self):
        self.tried = np.zeros((DEPTHS, RANKS))
        self.accepted = np.zeros((DEPTHS, RANKS))
        self._rates: Optional[np.ndarray] = None

    def record(self, node_slots: Sequence[Tuple[int, int]], parents: Sequence[int], path: Sequence[int]) -> None:
        """A verified tree (its nodes' slots and parents) and its accepted ``path``."""
        on_path = set(path)
        for node, ((depth, rank), parent) in enumerate(zip(node_slots, parents)):
            if parent < 0 or parent in on_path:
                self.tried[depth, rank] += 1
                self.accepted[depth, rank] += node in on_path
        self._rates = None

    def rates(self) -> np.ndarray:
        """P(accepted | parent accepted), [DEPTHS, RANKS]."""
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


def choose_across(chances: Sequence[Sequence[float]], verified: int, cost: Callable[[int], float],
                  drafting: float = 0.0) -> List[List[int]]:
    """The nodes of each row to verify: (row, node) pairs taken by chance, most likely
    first (a parent before its child; seat order only among equals), as many as give the
    most expected tokens per unit of ``cost(tokens)``, the pass over ``verified`` tokens
    (roots and unread tokens) and the nodes taken, plus ``drafting`` where any is taken
    (what a round with drafts costs past its pass: DraftCharge); each row's in node order.
    Each row's root yields a token whatever is drafted."""
    pairs = sorted((-chance, row, node) for row, row_chances in enumerate(chances)
                   for node, chance in enumerate(row_chances))
    expected = float(len(chances))
    best, best_value = 0, expected / cost(verified)
    for count, (negative, _, _) in enumerate(pairs, 1):
        expected -= negative
        value = expected / (cost(verified + count) + drafting)
        if value > best_value:
            best, best_value = count, value
    kept: List[List[int]] = [[] for _ in chances]
    for _, row, node in pairs[:best]:
        kept[row].append(node)
    return [sorted(nodes) for nodes in kept]


class DraftCharge:
    """What a batch's round with drafts costs past its packed pass's price, measured, that
    no price counts: the drafters' reads and next trees, accepting over trees rather than
    roots (about 11 ms a round at 8 rows on this CPU, where the pass itself is about 100).
    By the number of rows in the pass: the running means of rounds' measured time less
    their pass's price, over rounds that verified drafts and over rounds that verified roots
    alone; the first less the second is charged to the nodes of the next pass
    (choose_across's ``drafting``), so that a batch drafts only where its nodes pay for it
    too, and otherwise runs as plain batching. To keep both measured, one round in
    ``PLAIN_EVERY`` of a size verifies roots alone, and the charge fades while no round
    with drafts is measured (the drafters held back), so that they are tried again."""

    MEMORY = 0.8  # weight of the past in the running means
    PLAIN_EVERY = 32
    FADE = 0.97  # the charge's factor a round while no round with drafts is measured

    def __init__(self):
        self.residues: Dict[Tuple[int, bool], float] = {}  # (rows, drafted): ms past the pass's price
        self.rounds: Dict[int, int] = {}  # rounds priced, by rows
        self.since_drafted: Dict[int, int] = {}  # rounds since one with drafts was measured, by rows
        self.pending: Optional[Tuple[int, float, bool]] = None  # the round priced: rows, pass ms, drafted

    def charge(self, rows: int) -> Optional[float]:
        """Milliseconds to charge a pass over ``rows`` rows that verifies any node (0 while
        either kind of round is unmeasured); None: this round verifies roots alone."""
        count = self.rounds.get(rows, 0)
        self.rounds[rows] = count + 1
        if count % self.PLAIN_EVERY == self.PLAIN_EVERY // 2:
            return None
        drafted, plain = self.residues.get((rows, True)), self.residues.get((rows, False))
        if drafted is None or plain is None:
            return 0.0
        return max(drafted - plain, 0.0) * self.FADE ** self.since_drafted.get(rows, 0)

    def priced(self, rows: int, pass_ms: float, drafted: bool) -> None:
        """The round about to run: its pass over ``rows`` rows priced ``pass_ms``, verifying
        drafts or not."""
        self.pending = (rows, pass_ms, drafted)

    def took(self, seconds: Optional[float]) -> None:
        """The priced round's measured time (None: not comparable, as when a prompt's chunk
        rode its pass)."""
        pending, self.pending = self.pending, None
        if pending is None or seconds is None:
            return
        rows, pass_ms, drafted = pending
        residue = 1e3 * seconds - pass_ms
        last = self.residues.get((rows, drafted))
        self.residues[rows, drafted] = residue if last is None else self.MEMORY * last + (1 - self.MEMORY) * residue
        self.since_drafted[rows] = 0 if drafted else self.since_drafted.get(rows, 0) + 1


# One per target model in this process (weakly held): a server's turns and every
# batch_generate call over one model learn the same charge.
_CHARGES: Dict[int, Tuple["weakref.ref", DraftCharge]] = {}


def charge_of(model: object) -> DraftCharge:
    """The DraftCharge of batches over ``model``."""
    for dead in [key for key, (ref, _) in _CHARGES.items() if ref() is None]:
        del _CHARGES[dead]
    if id(model) not in _CHARGES:
        _CHARGES[id(model)] = (weakref.ref(model), DraftCharge())
    return _CHARGES[id(model)][1]
