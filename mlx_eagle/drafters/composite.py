"""Several draft sources in one round: their trees merged into one, shared prefixes once.

Sources are asked in order. Each sizes its part against what the round already holds:
the tokens verified so far and what they are expected to yield (each source's running
yield, measured per round), priced on this device's verify-cost curve by the source
itself (a context draft is as long as pays beside the head's tree, and nothing where
nothing does). The first source's tree is kept as it comes, its tokens possibly still
on the device; later ones are grafted onto it on the host, following nodes that already
hold their tokens, so that no token is verified twice.
"""

from __future__ import annotations

from dataclasses import replace
from typing import List, Optional, Sequence

import mlx.core as mx

from ..trees import DraftTree
from . import Budget, Drafter, Outcome, Proposal

# How fast a source's running yield follows the rounds.
YIELD_RATE = 0.1


class Composite(Drafter):
    """``drafters`` drafting together, merged into one tree each round."""

    def __init__(self, drafters: Sequence[Drafter]):
        self.drafters = list(drafters)
        taps = [d.taps for d in self.drafters if d.taps is not None]
        self.taps = tuple(sorted(set().union(*taps))) if taps else None
        self.yields = [1.0] * len(self.drafters)  # tokens a round's part from each source yields
        self._parts: List[Optional[Proposal]] = []
        self._nodes: List[List[int]] = []  # per source: its nodes' indices in the merged tree

    def finish(self) -> None:
        for drafter in self.drafters:
            drafter.finish()

    def reusable(self, common: int) -> int:
        return min((d.reusable(common) for d in self.drafters), default=common)

    def propose(self, budget: Budget) -> Optional[Proposal]:
        merged: Optional[Proposal] = None
        expected = budget.expected
        self._parts, self._nodes = [], []
        for index, drafter in enumerate(self.drafters):
            verified = budget.verified + (len(merged) if merged else 0)
            # Where only chains are verified, the first source's chain is the round's.
            nodes = 0 if budget.chain and merged else budget.nodes - (verified - budget.verified)
            part = drafter.propose(Budget(budget.room, nodes, verified, expected, budget.chain))
            self._parts.append(part)
            if part is None or not len(part):
                self._nodes.append([])
                continue
            if merged is None:  # kept as it comes: nothing is read from the device for a lone source
                merged = Proposal(DraftTree(list(part.tree.tokens), list(part.tree.parents), list(part.tree.depths)),
                                  part.tokens)
                self._nodes.append(list(range(len(part))))
            else:
                merged.host_tokens()
                self._nodes.append(merged.tree.merge(part.tree, part.host_tokens()))
                merged.tokens = mx.array(merged.tree.tokens, dtype=mx.int32)
            expected += self.yields[index] - 1.0
        return merged

    def observe(self, outcome: Outcome) -> None:
        """Each source observes the outcome with its own part and its own accepted nodes;
        ``outcome.path`` holds nodes of the merged tree."""
        accepted = set(outcome.path)
        for index, drafter in enumerate(self.drafters):
            part = self._parts[index] if outcome.proposal is not None else None
            path = [own for own, node in enumerate(self._nodes[index]) if node in accepted] if part else []
            if part is not None and len(part):
                self.yields[index] += YIELD_RATE * (1 + len(path) - self.yields[index])
            drafter.observe(replace(outcome, proposal=part, path=path))
