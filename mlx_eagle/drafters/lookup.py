"""Drafts from the context (prompt-lookup decoding): no head, no training.

Answers that fix, rewrite or reformat text copy long spans of the prompt, of
earlier turns or of themselves. The committed tokens' longest recent suffix (n
tokens, from ``max_ngram`` down to ``min_ngram``) is looked up among everything
committed so far, and the tokens that followed its most recent occurrence are the
draft. Verification keeps the output the target's own whatever is drafted.

How many tokens to draft is decided each round: the draft's expected accepted
tokens, from this conversation's own acceptance history per match length and
position, against what verifying them costs on this device (costs.Costs), beside
whatever the round verifies already. Where no length is expected to beat plain
decoding nothing is drafted, and the round costs what a plain step costs. It needs no
target states, so it drafts for any model mlx-lm loads whose cache can be rewound.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.nn as nn

from . import Budget, DraftSettings, DraftSource, Outcome, Proposal
from .chains import ChainDrafter

NAME = "lookup"


class ContextIndex:
    """Every n-gram (n in [min_ngram, max_ngram]) of the committed tokens, mapped to the
    position just after its most recent occurrence. Committing a token costs a few
    dictionary updates, whatever the context's length."""

    def __init__(self, min_ngram: int = 1, max_ngram: int = 4):
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.tokens: List[int] = []
        self.after: Dict[Tuple[int, ...], int] = {}

    def commit(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            end = len(self.tokens)  # every n-gram ending just before ``token`` now has a continuation
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self.after[tuple(self.tokens[end - n:end])] = end
            self.tokens.append(int(token))

    def reset(self, tokens: Sequence[int]) -> None:
        """Hold exactly ``tokens``: extended when they continue what is held, else rebuilt."""
        held = len(self.tokens)
        if self.tokens != list(tokens[:held]):
            self.tokens, self.after = [], {}
            held = 0
        self.commit(tokens[held:])

    def match(self) -> Tuple[int, int]:
        """(n, position after the most recent earlier occurrence of the last n tokens),
        longest n first; (0, -1) when nothing matches."""
        end = len(self.tokens)
        for n in range(min(self.max_ngram, end), self.min_ngram - 1, -1):
            position = self.after.get(tuple(self.tokens[end - n:]))
            if position is not None:
                return n, position
        return 0, -1

    def continuation(self, position: int, count: int) -> List[int]:
        """``count`` tokens from ``position`` on. Where the copy reaches the end of the
        context it repeats with the match's period (a repeated line goes on repeating)."""
        end = len(self.tokens)
        drafted: List[int] = []
        for j in range(count):
            source = position + j
            drafted.append(self.tokens[source] if source < end else drafted[source - end])
        return drafted


@dataclass
class LookupDraft:
    tokens: List[int]
    kind: int  # which acceptance history judges it: the match's length, and whether a copy goes on


class LookupDrafter(ChainDrafter):
    """Proposes this round's lookup draft, as long as is expected to pay off (see
    ChainDrafter), judged separately for each kind of draft: by the matched suffix's
    length, and by whether the last round's draft was accepted whole (a copy under way
    goes on far more often than a new one starts)."""

    def __init__(self, cost: Callable[[int], float], max_tokens: int = 16, min_ngram: int = 1,
                 max_ngram: int = 4):
        super().__init__(cost, max_tokens, kinds=2 * (max_ngram + 1))
        self.index = ContextIndex(min_ngram, max_ngram)
        self.copying = False  # the last round's draft was accepted whole
        self._proposed = LookupDraft([], 0)  # this round's draft

    def kind(self, ngram: int) -> int:
        return ngram + (self.index.max_ngram + 1) * self.copying

    def propose(self, budget: Budget) -> Optional[Proposal]:
        """At most ``budget.room`` tokens to follow the committed ones; none where no match
        is expected to pay off beside the ``budget.verified`` tokens the round verifies
        anyway, which yield ``budget.expected``."""
        ngram, position = self.index.match()
        kind = self.kind(ngram)
        self.copying = False  # until a draft is accepted whole
        limit = min(budget.room, budget.nodes, self.max_tokens)
        length = self.best_length(kind, limit, budget.verified, budget.expected) if ngram and limit >= 1 else 0
        self._proposed = LookupDraft(self.index.continuation(position, length), kind)
        return Proposal.chain(self._proposed.tokens) if length else None

    def record(self, draft: LookupDraft, accepted: int) -> None:
        """How many leading tokens of ``draft`` the target accepted."""
        self.record_chain(draft.kind, len(draft.tokens), accepted)
        self.copying = accepted == len(draft.tokens)

    def observe(self, outcome: Outcome) -> None:
        if outcome.proposal is not None and len(outcome.proposal):
            self.record(self._proposed, outcome.accepted)
        if outcome.from_prompt:
            self.index.reset(outcome.tokens)
        else:
            self.index.commit(outcome.new_tokens)


def recognizes(path: Path, config: Optional[dict]) -> bool:
    return False  # drafts from the context need no files: --draft lookup


def accepts(draft: object) -> bool:
    return draft == NAME


def source(draft: object, model: nn.Module, settings: DraftSettings) -> DraftSource:
    costs = settings.costs
    return DraftSource("context lookup", lambda: LookupDrafter(costs))
