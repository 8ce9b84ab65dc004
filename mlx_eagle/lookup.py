"""Drafts from the context (prompt-lookup decoding): no head, no training.

Answers that fix, rewrite or reformat text copy long spans of the prompt, of
earlier turns or of themselves. The committed tokens' longest recent suffix (n
tokens, from ``max_ngram`` down to ``min_ngram``) is looked up among everything
committed so far, and the tokens that followed its most recent occurrence are the
draft. Verification keeps the output the target's own whatever is drafted.

How many tokens to draft is decided each round: the draft's expected accepted
tokens, from this conversation's own acceptance history per match length and
position, against what verifying them costs on this device (``VerifyCosts``).
Where no length is expected to beat plain decoding nothing is drafted, and the
round costs what a plain step costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np


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
    ngram: int  # length of the matched suffix (the history it is judged by)


class LookupDrafter:
    """Proposes this round's lookup draft, as long as is expected to pay off.

    ``cost(k)``: a target forward over k tokens, in plain decoding steps. The
    probability that draft token j is accepted once tokens 1..j-1 were is estimated
    per match length from what this drafter saw accepted, shrunk towards the estimate
    for token j - 1 (deep positions start from what shallower ones show).
    """

    PRIOR_RATE = 0.5  # first draft token of a match length never tried yet
    PRIOR_WEIGHT = 2.0  # pseudo-observations behind each position's prior

    def __init__(self, cost: Callable[[int], float], max_tokens: int = 16, min_ngram: int = 1,
                 max_ngram: int = 4):
        self.cost, self.max_tokens = cost, max_tokens
        self.index = ContextIndex(min_ngram, max_ngram)
        self.tried = np.zeros((max_ngram + 1, max_tokens))
        self.accepted = np.zeros((max_ngram + 1, max_tokens))

    def acceptance(self, ngram: int) -> np.ndarray:
        """P(draft token j accepted | tokens before it were), j = 1..max_tokens."""
        rates = np.empty(self.max_tokens)
        prior = self.PRIOR_RATE
        for j in range(self.max_tokens):
            prior = rates[j] = ((self.accepted[ngram, j] + self.PRIOR_WEIGHT * prior)
                                / (self.tried[ngram, j] + self.PRIOR_WEIGHT))
        return rates

    def best_length(self, ngram: int, limit: int, verified: int, expected: float) -> int:
        """The draft length with the most expected tokens per unit of verification cost,
        beside ``verified`` tokens already in the round that yield ``expected`` tokens."""
        best_length, best_value = 0, expected / self.cost(verified)
        reach = 1.0
        for length, rate in enumerate(self.acceptance(ngram)[:limit], 1):
            reach *= rate
            expected += reach
            value = expected / self.cost(verified + length)
            if value > best_value:
                best_length, best_value = length, value
        return best_length

    def propose(self, limit: int, verified: int = 1, expected: float = 1.0) -> LookupDraft:
        """At most ``limit`` tokens to follow the committed ones; empty where no match is
        expected to pay off. ``verified``: tokens the round verifies anyway (the root and
        a head's tree), ``expected``: the tokens those are expected to yield."""
        ngram, position = self.index.match()
        if ngram == 0 or limit < 1:
            return LookupDraft([], 0)
        length = self.best_length(ngram, min(limit, self.max_tokens), verified, expected)
        return LookupDraft(self.index.continuation(position, length), ngram)

    def record(self, draft: LookupDraft, accepted: int) -> None:
        """How many leading tokens of ``draft`` the target accepted."""
        proposed = len(draft.tokens)
        self.tried[draft.ngram, :min(accepted + 1, proposed)] += 1
        self.accepted[draft.ngram, :accepted] += 1
