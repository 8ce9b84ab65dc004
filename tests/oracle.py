"""Heads for testing the decoding loop, with the interface of mlx_eagle.heads.

OracleHead knows the target's greedy continuation and drafts it, with planned
mistakes: at every third position the right token is only its second choice, so
accepted paths run through non-first branches and the KV caches must be compacted
from scattered slots. FixedDraft always proposes the same tokens in the same order.
"""

from typing import List, Sequence

import mlx.core as mx

from mlx_eagle import Drafter, Proposal


class _TestHead:
    family = "test"

    def taps(self, num_target_layers):
        return None

    def project(self, features):
        return features[:, :1]

    def _advance(self, cache, length: int):
        # The decoder reads positions off the draft cache: keep it in step.
        cache[0].update_and_fetch(mx.zeros((1, 1, length, 1)), mx.zeros((1, 1, length, 1)))

    def target_ids(self, draft_ids):
        return draft_ids


class OracleHead(_TestHead):
    def __init__(self, sequence: Sequence[int], vocab_size: int):
        self.sequence, self.vocab_size = list(sequence), vocab_size

    def step(self, target, hidden, tokens, cache, positions, mask):
        length = tokens.shape[1]
        self._advance(cache, length)
        starts = [positions + i for i in range(length)] if isinstance(positions, int) else positions.tolist()
        rows = []
        for position, token in zip(starts, tokens[0].tolist()):
            # Draft position j reads the token at target position j + 1 and guesses j + 2.
            here, guess = position + 1, position + 2
            right = self.sequence[guess] if guess < len(self.sequence) else 0
            known = here < len(self.sequence) and self.sequence[here] == token
            wrong = (right + 1) % self.vocab_size
            first, second = (wrong, right) if guess % 3 == 0 else (right, wrong)
            if not known:
                first, second = (token * 7 + 3) % self.vocab_size, (token * 5 + 1) % self.vocab_size
            row = mx.zeros((self.vocab_size,))
            row = row.at[second].add(1.0).at[first].add(2.0)
            rows.append(row)
        return mx.stack(rows)[None]

    def logits(self, target, hidden):
        return hidden


class FixedDraft(_TestHead):
    """Always drafts ``order`` (best first) whatever the context."""

    def __init__(self, order: List[int], vocab_size: int):
        scores = mx.full((vocab_size,), -1e9)
        for rank, token in enumerate(order):
            scores[token] = float(len(order) - rank)
        self.scores = scores

    def step(self, target, hidden, tokens, cache, positions, mask):
        self._advance(cache, tokens.shape[1])
        return mx.zeros((1, tokens.shape[1], 1))

    def logits(self, target, hidden):
        return mx.broadcast_to(self.scores, (*hidden.shape[:-1], self.scores.shape[0]))


class ScriptedDrafter(Drafter):
    """A drafter that knows the target's continuation ``sequence`` (prompt included) and
    drafts chains of it with planned mistakes: the draft at every ``wrong_every``-th position
    of the sequence is wrong, so chains are accepted part way, and some whole."""

    def __init__(self, sequence: Sequence[int], vocab_size: int, length: int = 4, wrong_every: int = 5):
        self.sequence, self.vocab_size, self.length, self.wrong_every = list(sequence), vocab_size, length, wrong_every
        self.committed = 0

    def observe(self, outcome):
        self.committed = len(outcome.tokens)

    def propose(self, budget):
        start = self.committed  # the sequence's index of the token after the root
        chain = self.sequence[start:start + min(self.length, budget.room, budget.nodes)]
        chain = [(t + 1) % self.vocab_size if (start + j) % self.wrong_every == 0 else t for j, t in enumerate(chain)]
        return Proposal.chain(chain) if chain else None
