"""Drafts from the context (prompt-lookup decoding) and from earlier replies (suffix
decoding): no head, no training.

Answers that fix, rewrite or reformat text copy long spans of the prompt, of
earlier turns or of themselves. The committed tokens' longest recent suffix (n
tokens, from ``max_ngram`` down to ``min_ngram``) is looked up among everything
committed so far, and the tokens that followed its most recent occurrence are the
draft. Desktop tools and agents also ask the same kind of thing again and again: the
replies of earlier requests to the same model are kept in a ``History`` (per model, in
memory, optionally on disk), and where the end of the text matches them longer than it
matches the conversation, the draft is a tree of their most frequent continuations,
each node scored by its count ratio (suffix decoding, arXiv 2411.04975). Verification
keeps the output the target's own whatever is drafted.

How many tokens to draft is decided each round: the draft's expected accepted
tokens, from this conversation's own acceptance history per match length and
position, against what verifying them costs on this device (costs.Costs), beside
whatever the round verifies already. Where no length is expected to beat plain
decoding nothing is drafted, and the round costs what a plain step costs. It needs no
target states, so it drafts for any model mlx-lm loads whose cache can be rewound.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..trees import DraftTree
from . import Budget, Outcome, Proposal
from .chains import ChainDrafter
from .history import History
from .kinds import DraftSettings, DraftSource

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

    def match_length(self, position: int, limit: int) -> int:
        """How many tokens before ``position`` equal the context's last ones (at most ``limit``)."""
        tokens, end, length = self.tokens, len(self.tokens), 0
        while length < limit and position - length - 1 >= 0 and end - length - 1 > position - length - 1 \
                and tokens[position - length - 1] == tokens[end - length - 1]:
            length += 1
        return length

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


def continuation_tree(continuations: Sequence[Sequence[int]], nodes: int,
                      min_probability: float = 0.1) -> Tuple[DraftTree, List[float]]:
    """The most frequent continuations as a tree of at most ``nodes`` nodes: each node's
    probability is its count over its parent's, times its parent's; nodes are taken best
    first while their probability is at least ``min_probability``. Nodes come parents first."""
    trie: Dict[Tuple[int, ...], int] = {}
    for continuation in continuations:
        for depth in range(1, len(continuation) + 1):
            prefix = tuple(int(t) for t in continuation[:depth])
            trie[prefix] = trie.get(prefix, 0) + 1
    children: Dict[Tuple[int, ...], List[Tuple[int, ...]]] = {}
    for prefix in trie:
        children.setdefault(prefix[:-1], []).append(prefix)
    total = len(continuations)
    heap = [(-trie[c] / total, c) for c in children.get((), [])]
    heapq.heapify(heap)
    tree, probabilities, placed = DraftTree(), [], {(): -1}
    while heap and len(tree) < nodes:
        negative, prefix = heapq.heappop(heap)
        if -negative < min_probability:
            break
        placed[prefix] = tree.add(prefix[-1], placed[prefix[:-1]])
        probabilities.append(-negative)
        for child in children.get(prefix, []):
            heapq.heappush(heap, (negative * trie[child] / trie[prefix], child))
    return tree, probabilities


class LookupDrafter(ChainDrafter):
    """Proposes this round's lookup draft, as long as is expected to pay off (see
    ChainDrafter), judged separately for each kind of draft: by the matched suffix's
    length, and by whether the last round's draft was accepted whole (a copy under way
    goes on far more often than a new one starts). With a ``history``, drafts from earlier
    replies where they match the end of the text longer than the conversation does."""

    MAX_MATCH = 32  # tokens a match is followed back

    def __init__(self, pricing: Callable[[int], float], max_tokens: int = 16, min_ngram: int = 1,
                 max_ngram: int = 4, history: Optional[History] = None):
        super().__init__(pricing, max_tokens, kinds=2 * (max_ngram + 1) + 1)
        self.index = ContextIndex(min_ngram, max_ngram)
        self.history = history
        self.copying = False  # the last round's draft was accepted whole
        self._proposed = LookupDraft([], 0)  # this round's draft
        self._history_yield = 1.0  # accepted over expected tokens of history drafts so far
        self._expected = 0.0  # what this round's history draft was expected to yield
        self._reply_start: Optional[int] = None  # where this request's reply begins in index.tokens

    HISTORY_KIND = -1  # the last row of the acceptance tables

    def kind(self, ngram: int) -> int:
        return ngram + (self.index.max_ngram + 1) * self.copying

    def propose(self, budget: Budget) -> Optional[Proposal]:
        """At most ``budget.room`` tokens to follow the committed ones; none where no match
        is expected to pay off beside the ``budget.verified`` tokens the round verifies
        anyway, which yield ``budget.expected``."""
        self.price(budget)
        ngram, position = self.index.match()
        kind = self.kind(ngram)
        self.copying = False  # until a draft is accepted whole
        limit = min(budget.room, budget.nodes, self.max_tokens)
        if self.history is not None and limit >= 1:
            conversation = self.index.match_length(position, self.MAX_MATCH) if ngram else 0
            drafted = self._from_history(budget, limit, conversation)
            if drafted is not None:
                return drafted
        length = self.best_length(kind, limit, budget.verified, budget.expected) if ngram and limit >= 1 else 0
        self._proposed = LookupDraft(self.index.continuation(position, length), kind)
        return Proposal.chain(self._proposed.tokens) if length else None

    def _from_history(self, budget: Budget, limit: int, conversation: int) -> Optional[Proposal]:
        """A tree of earlier replies' continuations, where they match longer than the
        conversation: as deep as the match is long (up to ``limit``), as many nodes as
        their expected yield pays for on this device."""
        matched, continuations = self.history.match(self.index.tokens, self.MAX_MATCH, limit)
        if matched <= conversation or not continuations:
            return None
        depth = min(limit, matched)
        tree, probabilities = continuation_tree([c[:depth] for c in continuations],
                                                1 if budget.chain else budget.nodes)
        expected, count = budget.expected, 0
        for probability in probabilities:  # nodes come best first: keep them while each pays
            value = probability * self._history_yield
            nodes = budget.verified + count
            if (expected + value) / self.pricing(nodes + 1) <= expected / self.pricing(nodes):
                break
            expected, count = expected + value, count + 1
        if not count:
            return None
        tree = DraftTree(tree.tokens[:count], tree.parents[:count], tree.depths[:count])  # a prefix is a tree
        if budget.chain and not tree.is_chain():
            return None
        self._proposed = LookupDraft(list(tree.tokens), self.HISTORY_KIND)
        self._expected = expected - budget.expected
        return Proposal(tree, mx.array(tree.tokens, dtype=mx.int32))

    def record(self, draft: LookupDraft, accepted: int) -> None:
        """How many leading tokens of ``draft`` the target accepted."""
        if draft.kind == self.HISTORY_KIND:
            self._history_yield += 0.2 * (min(1.0, accepted / max(self._expected, 1e-6)) - self._history_yield)
            self._history_yield = min(1.0, max(0.1, self._history_yield))
            return
        self.record_chain(draft.kind, len(draft.tokens), accepted)
        self.copying = accepted == len(draft.tokens)

    def branch(self) -> "LookupDrafter":
        # What drafts were accepted so far, kept; the index is rebuilt from the next prompt.
        twin = self.twin()
        twin.index = ContextIndex(self.index.min_ngram, self.index.max_ngram)
        twin._reply_start = None
        return twin

    def observe(self, outcome: Outcome) -> None:
        if outcome.proposal is not None and len(outcome.proposal):
            self.record(self._proposed, outcome.accepted)
        if outcome.from_prompt:
            self.finish()  # a new request: the last one's reply is final
            self.index.reset(outcome.tokens)
            self._reply_start = len(outcome.tokens) - 1
        else:
            self.index.commit(outcome.new_tokens)

    def finish(self) -> None:
        """The reply is over: it joins the history that later requests draft from."""
        if self.history is not None and self._reply_start is not None:
            self.history.add(self.index.tokens[self._reply_start:])
        self._reply_start = None


def recognizes(path: Path, config: Optional[dict]) -> bool:
    return False  # drafts from the context need no files: --draft lookup


def accepts(draft: object) -> bool:
    return draft == NAME


def source(draft: object, model: nn.Module, settings: DraftSettings) -> DraftSource:
    pricing, history = settings.costs.at(), settings.history
    name = "context lookup" + (" (with earlier replies)" if history is not None else "")
    return DraftSource(name, lambda: LookupDrafter(pricing, history=history))
