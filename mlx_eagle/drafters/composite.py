"""Several draft sources in one round: their trees merged into one, shared prefixes once.

Sources are asked in order. Each sizes its part against what the round already holds:
the tokens verified so far and what they are expected to yield (each source's running
yield, measured per round), priced on this device's verify-cost curve by the source
itself (a context draft is as long as pays beside the head's tree, and nothing where
nothing does). Each part is admitted (admit.py) before it joins: a malformed one is left
out of the round. The first source's tree is kept as it comes, its tokens possibly still
on the device; later ones are grafted onto it on the host, following nodes that already
hold their tokens, so that no token is verified twice.

Each source is credited with the nodes it added first and those of them the target
accepted (``statistics``): what each source bought in a merged tree.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..trees import DraftTree
from . import Budget, Drafter, Outcome, Proposal
from .admit import admit_or_warn

# How fast a source's running yield follows the rounds.
YIELD_RATE = 0.1


@dataclass
class SourceStats:
    """One source's part of a reply: the nodes it added to the verified trees (those
    another source had added before it in the same round not counted), and how many of
    them the target accepted."""

    proposed: int = 0
    accepted: int = 0


class Composite(Drafter):
    """``drafters`` drafting together, merged into one tree each round; ``names``: what
    each is called in statistics and warnings."""

    def __init__(self, drafters: Sequence[Drafter], names: Optional[Sequence[str]] = None):
        self.drafters = list(drafters)
        self.names = list(names) if names is not None else [type(d).__name__ for d in self.drafters]
        taps = [d.taps for d in self.drafters if d.taps is not None]
        self.taps = tuple(sorted(set().union(*taps))) if taps else None
        self.yields = [1.0] * len(self.drafters)  # tokens a round's part from each source yields
        self.stats = [SourceStats() for _ in self.drafters]
        self._parts: List[Optional[Proposal]] = []
        self._nodes: List[List[int]] = []  # per source: its nodes' indices in the merged tree
        self._owners: List[int] = []  # per merged node: the source that added it

    def statistics(self) -> Dict[str, SourceStats]:
        """Per source, what it added and what of that was accepted since the drafters were made."""
        return {name: replace(stats) for name, stats in zip(self.names, self.stats)}

    def finish(self) -> None:
        for drafter in self.drafters:
            drafter.finish()

    def branch(self) -> Optional["Composite"]:
        """Every source's copy (None where one cannot be copied), with fresh statistics."""
        twins = [drafter.branch() for drafter in self.drafters]
        if any(twin is None for twin in twins):
            return None
        composite = Composite(twins, self.names)
        composite.yields = list(self.yields)
        return composite

    def reusable(self, common: int) -> int:
        return min((d.reusable(common) for d in self.drafters), default=common)

    def propose(self, budget: Budget) -> Optional[Proposal]:
        merged: Optional[Proposal] = None
        expected = budget.expected
        self._parts, self._nodes, self._owners = [], [], []
        for index, drafter in enumerate(self.drafters):
            verified = budget.verified + (len(merged) if merged else 0)
            # Where only chains are verified, the first source's chain is the round's.
            nodes = 0 if budget.chain and merged else budget.nodes - (verified - budget.verified)
            part_budget = replace(budget, nodes=nodes, verified=verified, expected=expected)
            part = admit_or_warn(drafter, drafter.propose(part_budget), part_budget, self.names[index])
            self._parts.append(part)
            if part is None:
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
            self._owners += [index] * (len(merged) - len(self._owners))
            expected += self.yields[index] - 1.0
        return merged

    def observe(self, outcome: Outcome) -> None:
        for drafter, part in self.learners(outcome):
            drafter.observe(part)

    def learners(self, outcome: Outcome) -> List[Tuple[Drafter, Outcome]]:
        """Each source, with the outcome as it sees it: its own part and its own accepted
        nodes (``outcome.path`` holds nodes of the merged tree); the statistics and
        yields counted."""
        # The merged tree's nodes verified, and where each is in what was verified (all of
        # them, but where a batch kept only some: Outcome.kept).
        verified = outcome.kept if outcome.kept is not None else range(len(self._owners))
        place = {node: at for at, node in enumerate(verified)}
        accepted = {verified[at] for at in outcome.path}
        if outcome.proposal is not None:
            for node in verified:
                self.stats[self._owners[node]].proposed += 1
            for node in accepted:
                self.stats[self._owners[node]].accepted += 1
        learners = []
        for index, drafter in enumerate(self.drafters):
            part = self._parts[index] if outcome.proposal is not None else None
            kept, path = None, []
            if part is not None and outcome.kept is not None:  # its own nodes the batch verified
                kept = [own for own, node in enumerate(self._nodes[index]) if node in place]
                part = part.only(kept)  # (empty where none was: proposed, none verified)
            if part:
                nodes = [self._nodes[index][own] for own in kept] if kept is not None else self._nodes[index]
                path = [own for own, node in enumerate(nodes) if node in accepted]
                self.yields[index] += YIELD_RATE * (1 + len(path) - self.yields[index])
            learners += drafter.learners(replace(outcome, proposal=part, path=path, kept=kept))
        return learners
