"""Thinking budgets inside speculation: a reasoning model's thinking ended after a budget of
tokens, exactly as plain decoding with the same rule would end it.

The rule (``ThinkingBudget``): the thinking is open from the template's start marker (the
prompt's, when the chat template opens the block itself, or one the reply writes) to its
end marker. Once the reply's thinking holds ``budget`` tokens (over all its thinking blocks),
the end marker's tokens are the only ones allowed, one after another: the marker is forced
where the budget runs out, as a logits processor would force it in plain decoding. The
markers are the tokenizer's own (mlx-lm reads them from its vocabulary: ``<think>`` and
``</think>``, and the other spellings it knows); a model without them has nothing to budget.

Inside a speculative round, the budget shapes the tree as a grammar does (grammar.py, the
same seam of the decoder): a drafted node past the boundary that is not the marker is cut
with its subtree (the target could never accept it), the marker's tokens are grafted after
the drafter's best path (drafted for free: they are certain), and the rows where the marker
is forced are masked to it before the round accepts, so that greedy choices and sampled
distributions are those of plain decoding under the rule. Rounds that cannot reach the budget
are not shaped at all, and rows that are not forced are not masked: the budget costs nothing
until it is near.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .drafters.composite import SourceStats
from .errors import UserError
from .grammar import Shaped
from .trees import DraftTree

# Budgets for the effort levels clients name (OpenAI's reasoning.effort and chat completions'
# reasoning_effort, Anthropic's output_config.effort): thinking tokens, sized for a local
# model's replies. "none": no thinking (its block ends at once); "max": no budget.
EFFORT_BUDGETS = {"none": 0, "minimal": 128, "low": 512, "medium": 2048, "high": 8192, "xhigh": 16384, "max": None}


@dataclass(frozen=True)
class _State:
    open: bool  # inside a thinking block
    spent: int  # thinking tokens so far, over all blocks
    matched: int  # tokens of the marker being matched so far: the end marker while open, else the start


class ThinkingBudget:
    """One reply's thinking budget: what its committed tokens have spent."""

    forced_source = "thinking budget (forced tokens)"  # the name of the tokens it forces, in statistics

    def __init__(self, start: Sequence[int], end: Sequence[int], budget: int, prompt: Sequence[int], vocab: int):
        self.start, self.end, self.budget = tuple(start), tuple(end), budget
        self.words = (vocab + 31) // 32
        self.state = _State(_opens(prompt, self.start, self.end), 0, 0)
        self.forced = SourceStats()  # the marker tokens drafted in this reply, and how many were accepted

    def _step(self, state: _State, token: int) -> _State:
        marker = self.end if state.open else self.start
        matched = state.matched + 1 if marker[state.matched] == token else int(marker[0] == token)
        spent = state.spent + state.open
        if matched == len(marker):
            return _State(not state.open, spent, 0)
        return _State(state.open, spent, matched)

    def _forced(self, state: _State) -> Optional[int]:
        """The one token allowed after ``state`` (None: any)."""
        return self.end[state.matched] if state.open and state.spent >= self.budget else None

    def _masks(self, states: Sequence[_State]) -> Optional[mx.array]:
        """[rows, words] uint32: each state's allowed tokens; None where every row is free."""
        forced = [self._forced(state) for state in states]
        if all(token is None for token in forced):
            return None
        rows = np.full((len(states), self.words), 0xFFFFFFFF, dtype=np.uint32)
        for row, token in enumerate(forced):
            if token is not None:
                rows[row] = 0
                rows[row, token >> 5] = np.uint32(1 << (token & 31))
        return mx.array(rows)

    def mask_now(self) -> Optional[mx.array]:
        """[1, words]: the allowed tokens after what was committed (None: any)."""
        return self._masks([self.state])

    def binds(self, room: int) -> bool:
        """Whether a round whose rows lie at most ``room`` tokens past what was committed may
        reach the budget (else it is not shaped at all: its drafts stay on the device, its rows
        unmasked). The spent count only grows, by at most a token a position."""
        return self.state.spent + room >= self.budget

    def commit(self, tokens: Sequence[int], shaped: Optional[Shaped] = None, path: Sequence[int] = ()) -> None:
        """Tokens the reply now holds; after a round, the ``shaped`` tree it verified and the
        nodes of it accepted (``path``)."""
        if shaped is not None:
            self.forced.proposed += len(shaped.tree) - shaped.forced_from
            self.forced.accepted += sum(1 for node in path if node >= shaped.forced_from)
        for token in tokens:
            self.state = self._step(self.state, int(token))

    def shape(self, tokens: Sequence[int], parents: Sequence[int], room: int, nodes: int) -> Shaped:
        """The tree the target verifies this round, from a drafter's (``tokens``, ``parents``):
        see the module's docstring. ``room``: how deep a node may be; ``nodes``: how many the
        tree may hold."""
        tree, placed, states = DraftTree(), [], []  # states: after each node of the tree
        for token, parent in zip(tokens, parents):
            at = placed[parent] if parent >= 0 else -1
            if at is None:  # its parent was cut
                placed.append(None)
                continue
            before = states[at] if at >= 0 else self.state
            forced = self._forced(before)
            if forced is not None and forced != token:
                placed.append(None)
                continue
            placed.append(tree.add(int(token), at))
            states.append(self._step(before, int(token)))
        forced_from, best = len(tree), -1
        children = tree.children()
        while children.get(best):
            best = children[best][0]
        state = states[best] if best >= 0 else self.state
        room = min(room - (tree.depths[best] if best >= 0 else 0), nodes - len(tree))
        while room > 0 and self._forced(state) is not None:
            token = self._forced(state)
            best = tree.add(token, best)
            state = self._step(state, token)
            states.append(state)
            room -= 1
        masks = self._masks([self.state] + states)
        return Shaped(tree, mx.array(tree.tokens, dtype=mx.int32), placed, masks, forced_from)


def _opens(prompt: Sequence[int], start: Tuple[int, ...], end: Tuple[int, ...]) -> bool:
    """Whether ``prompt`` leaves a thinking block open: its last start marker comes after its
    last end marker (the chat template opened the block for the reply)."""
    def last(marker: Tuple[int, ...]) -> int:
        for at in range(len(prompt) - len(marker), -1, -1):
            if tuple(prompt[at:at + len(marker)]) == marker:
                return at
        return -1

    return last(start) > last(end)


def thinks(tokenizer) -> bool:
    """Whether the model has thinking markers (mlx-lm reads them from its vocabulary)."""
    return bool(getattr(tokenizer, "has_thinking", False) and tokenizer.think_start_tokens
                and tokenizer.think_end_tokens)


def opens_thinking(tokenizer, prompt: Sequence[int]) -> bool:
    """Whether the reply to ``prompt`` begins inside a thinking block its template opened."""
    return thinks(tokenizer) and _opens(prompt, tuple(tokenizer.think_start_tokens),
                                        tuple(tokenizer.think_end_tokens))


def check_budget(budget: object, where: str = "thinking_budget") -> Optional[int]:
    """A budget as given (None: none): a whole number of tokens, 0 or more."""
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise UserError(f"{where} must be a whole number of tokens, 0 or more, not {budget!r}", where)
    return budget


def check_budget_alone(tokenizer, budget: Optional[int], response_format: object) -> None:
    """One line where a budget would hold a model's thinking in a reply a ``response_format``
    holds too: the format would forbid the thinking."""
    if budget is not None and response_format is not None and thinks(tokenizer):
        raise UserError("a thinking budget and a structured output format cannot hold one reply together (the "
                        "format would forbid the thinking); send one of them", "response_format")


def thinking_budget_for(tokenizer, prompt: Sequence[int], budget: Optional[int], vocab: int,
                        response_format: object = None) -> Optional[ThinkingBudget]:
    """A fresh budget for one reply to ``prompt`` (None: no budget, or a model without
    thinking markers, whose replies have no thinking to end). A budget cannot hold a reply
    that a ``response_format`` holds too: one line (check_budget_alone)."""
    budget = check_budget(budget)
    check_budget_alone(tokenizer, budget, response_format)
    if budget is None or not thinks(tokenizer):
        return None
    return ThinkingBudget(tokenizer.think_start_tokens, tokenizer.think_end_tokens, budget, prompt, vocab)


def effort_budget(effort: object, where: str) -> Optional[int]:
    """The thinking budget an effort level names (EFFORT_BUDGETS; None: no effort given, or
    no budget)."""
    if effort is None:
        return None
    if effort not in EFFORT_BUDGETS:
        raise UserError(f"{where} must be one of {', '.join(EFFORT_BUDGETS)}, not {effort!r}", where)
    return EFFORT_BUDGETS[effort]

