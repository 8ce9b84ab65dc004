"""A drafter written against the public protocol alone, as a user would: a table of which
tokens followed each token and token pair in the conversation so far, proposing up to
three branches at the root. Named on command lines as ``table_drafter:TableDrafter``."""

from collections import Counter, defaultdict

import mlx.core as mx

from mlx_eagle import Drafter, Proposal
from mlx_eagle.trees import DraftTree


class TableDrafter(Drafter):
    def __init__(self, depth: int = 6):
        self.depth = depth
        self.tokens = []
        self.follows = defaultdict(Counter)  # (previous token(s)) -> counts of the next token
        self.conversations = 0  # prompts that did not continue what this drafter saw

    def observe(self, outcome):
        if outcome.from_prompt and outcome.tokens[:len(self.tokens) - 1] != self.tokens[:-1]:
            self.conversations += 1
        for index in range(max(outcome.start, 1), len(outcome.tokens)):
            token = outcome.tokens[index]
            self.follows[(outcome.tokens[index - 1],)][token] += 1
            if index >= 2:
                self.follows[tuple(outcome.tokens[index - 2:index])][token] += 1
        self.tokens = list(outcome.tokens)

    def _next(self, context):
        for key in (tuple(context[-2:]), tuple(context[-1:])):
            if self.follows.get(key):
                return [token for token, _ in self.follows[key].most_common(3)]
        return []

    def propose(self, budget):
        tree = DraftTree()
        for branch in self._next(self.tokens)[:3]:
            context, parent = list(self.tokens) + [branch], tree.add(branch, -1)
            for _ in range(min(self.depth, budget.room) - 1):
                following = self._next(context)
                if not following:
                    break
                parent = tree.add(following[0], parent)
                context.append(following[0])
        return Proposal(tree, mx.array(tree.tokens, dtype=mx.int32)) if len(tree) else None  # cut to the budget


NOT_A_DRAFTER = 42


def needs_phrases(phrases):
    return TableDrafter()
