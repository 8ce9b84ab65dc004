"""Drafters of chains whose length is chosen each round: the expected accepted tokens,
from what this drafter saw accepted, against what verifying (and drafting) them costs on
this device. Where no length is expected to beat plain decoding, none is drafted."""

from __future__ import annotations

import copy
from typing import Callable, Dict, Tuple

import numpy as np

from . import Budget, Drafter


class ChainDrafter(Drafter):
    """Sizes chains. ``pricing(k)``: a target forward over k tokens, in plain decoding steps
    (costs.Pricing: each round's Budget brings its own, which ``price`` keeps);
    ``step_cost``: drafting one token, in the same units (0 for drafts that cost nothing).
    The probability that draft token j is accepted once tokens 1..j-1 were is estimated
    from what was accepted, shrunk towards the estimate for token j - 1 (deep positions
    start from what shallower ones show), separately for each of ``kinds`` kinds of draft
    (what a drafter tells apart, e.g. how a draft was found)."""

    PRIOR_RATE = 0.5  # first draft token of a kind never tried yet
    PRIOR_WEIGHT = 2.0  # pseudo-observations behind each position's prior
    # Cost tables kept per (verified, pricing): in a batch the pricing changes with the
    # pass's shape nearly every round, so the table is emptied past this many.
    PRICES_KEPT = 256

    def __init__(self, pricing: Callable[[int], float], max_tokens: int = 16, kinds: int = 1,
                 step_cost: float = 0.0, round_cost: float = 0.0):
        """``round_cost``: drafting a round's drafts at once (a block drafter's pass), in plain
        decoding steps, paid whatever their number."""
        self.pricing, self.max_tokens, self.step_cost, self.round_cost = pricing, max_tokens, step_cost, round_cost
        self._costs: Dict[Tuple[int, Callable], np.ndarray] = {}  # (verified, pricing) -> verifying 0.. more
        self.tried = np.zeros((kinds, max_tokens))  # by kind and position
        self.accepted = np.zeros((kinds, max_tokens))

    def twin(self) -> "ChainDrafter":
        """A shallow copy with acceptance tables of its own (``branch`` starts from it)."""
        twin = copy.copy(self)
        twin.tried, twin.accepted, twin._costs = self.tried.copy(), self.accepted.copy(), dict(self._costs)
        return twin

    def acceptance(self, kind: int) -> np.ndarray:
        """P(draft token j accepted | tokens before it were), j = 1..max_tokens."""
        rates = np.empty(self.max_tokens)
        prior = self.PRIOR_RATE
        for j in range(self.max_tokens):
            prior = rates[j] = ((self.accepted[kind, j] + self.PRIOR_WEIGHT * prior)
                                / (self.tried[kind, j] + self.PRIOR_WEIGHT))
        return rates

    def price(self, budget: Budget) -> None:
        """Price what follows by this round's Budget (kept for what ``observe`` decides before
        the next round: this conversation's own last prices)."""
        if budget.pricing is not None:
            self.pricing = budget.pricing

    def best_length(self, kind: int, limit: int, verified: int, expected: float, drafted: bool = True) -> int:
        """The draft length with the most expected tokens per unit of cost, beside
        ``verified`` tokens already in the round that yield ``expected`` tokens."""
        return self.best_prefix(np.cumprod(self.acceptance(kind)[:limit]), verified, expected, drafted)

    def best_prefix(self, reach: np.ndarray, verified: int, expected: float, drafted: bool = True) -> int:
        """How many of a chain's drafts to verify, draft j reached (accepted with all before
        it) with chance ``reach[j - 1]``: the most expected tokens per unit of cost (where
        the drafts are not ``drafted`` yet, making them, ``round_cost``, counted too)."""
        key = (verified, self.pricing)  # (a Pricing is a value: the context and the pass it prices)
        if key not in self._costs:
            if len(self._costs) >= self.PRICES_KEPT:
                self._costs.clear()
            self._costs[key] = np.array([self.pricing(verified + n) + self.step_cost * n
                                         for n in range(self.max_tokens + 1)])
        making = 0.0 if drafted else self.round_cost  # (no draft: nothing to make)
        costs = self._costs[key][:len(reach) + 1] + making * (np.arange(len(reach) + 1) > 0)
        values = (expected + np.concatenate([[0.0], np.cumsum(reach)])) / costs
        return int(np.argmax(values))  # the shortest of equals: 0 (no draft) on a tie

    def record_chain(self, kind: int, proposed: int, accepted: int) -> None:
        """``accepted`` leading tokens of a ``proposed``-token chain of ``kind`` were accepted."""
        self.tried[kind, :min(accepted + 1, proposed)] += 1
        self.accepted[kind, :accepted] += 1
