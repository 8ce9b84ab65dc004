"""Accepting draft tokens so the output is exactly the target's own.

Greedy: follow the child equal to the target's argmax. Sampling: multi-draft
recursive rejection sampling. At each accepted node the target's distribution p
(after temperature, top-p, min-p, top-k, as mlx-lm's sampler applies them) is
tested against the node's children in order: a child x drafted deterministically
(q(x) = 1) is accepted with probability p(x); on rejection p(x) is set to 0 and p
renormalised. When every child is rejected, or the node is a leaf, the bonus token
is drawn from what remains. Each emitted token is then distributed exactly as p.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, List, Optional, Tuple

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from .errors import UserError
from .trees import DraftTree


# Settings too small to compute decode greedily, their limit: 1/temp would overflow float32
# below about 3e-39 (and lose all precision well before), and a top-p this small keeps the
# most likely token alone.
MIN_TEMPERATURE = 1e-4
MIN_TOP_P = 1e-6


@dataclass
class Sampling:
    temp: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0

    def __post_init__(self) -> None:
        """One line naming a setting that would sample nonsense (or nothing)."""
        numbers = {"temp": self.temp, "top_p": self.top_p, "min_p": self.min_p}
        for name, value in numbers.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise UserError(f"{name} must be a finite number, not {value!r}")
        if self.temp < 0:
            raise UserError(f"temp must be 0 (greedy) or more, not {self.temp}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be above 0 and at most 1 (1: no top-p), not {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise UserError(f"min_p must be from 0 (no min-p) to 1, not {self.min_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise UserError(f"top_k must be a whole number, 0 (no top-k) or more, not {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        """Greedy decoding: temp 0, or settings too small to compute (see MIN_TEMPERATURE)."""
        return self.temp < MIN_TEMPERATURE or self.top_p < MIN_TOP_P

    def probabilities(self, logits: mx.array) -> mx.array:
        """The distribution mlx-lm's make_sampler(temp, top_p, min_p, top_k=...) samples from."""
        logprobs = logits.astype(mx.float32)
        logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
        if 0 < self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p != 0.0:
            logprobs = apply_min_p(logprobs, self.min_p)
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        return mx.softmax(logprobs * (1.0 / self.temp), axis=-1)


@dataclass
class Verdict:
    path: List[int]  # accepted node indices, root's child first
    tokens: List[int]  # their tokens
    bonus: int  # the target's own next token after them
    # Greedy: the position after the path had its top two logits closer than the block's
    # tolerance, so ``bonus`` may not be what plain decoding picks: decide it with one row.
    unsure: bool = False


def sample(probs: mx.array, key: Optional[mx.array]) -> mx.array:
    """One draw from each row of ``probs`` (zeros allowed), on the device."""
    return mx.random.categorical(mx.log(probs), key=key)


def accept(tree: DraftTree, tokens: mx.array, logits: mx.array, sampling: Sampling,
           key: Optional[mx.array] = None, tolerance: float = 0.0) -> Verdict:
    """Walk the tree from the root. ``tokens`` [n]: the nodes' tokens; ``logits``
    [1 + n, vocab]: the target's at the root, then at each node; ``key``: for sampling;
    ``tolerance``: greedy, how close two logits of one block row may come before the row's
    choice is left to a one-row pass (Verdict.unsure; 0: trusted as computed).

    Everything vocabulary-sized stays on the device; one read brings back what the walk
    needs. Greedy: the target's choice at each position. Sampling: for every node, the
    uniform test it would face if its turn came (its parent's mass left after its
    earlier siblings' rejection is known in advance, since they precede it), and for
    every position a draw from its distribution with all its children removed: the
    bonus if the walk ends there. Each is used at most once, so the walk is exact.
    Token ids the drafter may have left unchecked on the device (drafters/admit.py) are
    safe here: an id outside the vocabulary is never accepted, and neither is a sibling
    repeating an earlier one (its probability went with the earlier one's rejection)."""
    if sampling.greedy:
        choice = mx.argmax(logits, axis=-1)
        close = too_close(logits, tolerance) if tolerance > 0 else None
        mx.eval(choice, tokens, *([close] if close is not None else []))
        choice, node_tokens = choice.tolist(), tokens.tolist()
        return _walk(tree, lambda node: node_tokens[node] == choice[tree.parents[node] + 1], node_tokens, choice,
                     close.tolist() if close is not None else None)
    probs = sampling.probabilities(logits)
    uniform_key, bonus_key = mx.random.split(key) if key is not None else (None, None)
    if len(tree):
        rows = mx.array([parent + 1 for parent in tree.parents])
        vocab = logits.shape[-1]
        valid = (tokens >= 0) & (tokens < vocab)
        safe = mx.where(valid, tokens, 0)
        before = mx.array(_earlier_siblings(tuple(tree.parents)))
        repeats = (before * (tokens[:, None] == tokens[None, :])).max(axis=1) > 0
        # each node's probability under its parent's distribution, none for a repeat or an id outside
        drafted = probs[rows, safe] * (valid & ~repeats)
        left = probs.sum(axis=-1)[rows] - before @ drafted
        passes = mx.random.uniform(shape=(len(tree),), key=uniform_key) * left < drafted
        probs = probs.at[rows, safe].multiply((~valid).astype(probs.dtype))  # the children removed
    else:
        passes = mx.array([], dtype=mx.bool_)
    bonus = sample(probs, bonus_key)
    mx.eval(passes, bonus, tokens)
    passes, node_tokens = passes.tolist(), tokens.tolist()
    return _walk(tree, lambda node: passes[node], node_tokens, bonus.tolist())


def too_close(logits: mx.array, tolerance: float) -> mx.array:
    """Per row of ``logits``, whether its top two lie within ``tolerance``: a greedy choice
    that another kernel's rounding could flip."""
    top = mx.topk(logits, 2, axis=-1).astype(mx.float32)
    return mx.abs(top[..., 0] - top[..., 1]) <= tolerance


def _walk(tree: DraftTree, passes: Callable[[int], bool], node_tokens: List[int], bonus: List[int],
          close: Optional[List[bool]] = None) -> Verdict:
    """From the root into the first child that passes, while one does; then the bonus
    token of the position where the walk ended (``bonus[0]``: the root's). A position
    whose row is ``close`` ends the walk there, unsure."""
    children = tree.children()
    path, node = [], -1
    while True:
        if close is not None and close[node + 1]:
            return Verdict(path, [node_tokens[n] for n in path], bonus[node + 1], unsure=True)
        match = next((child for child in children.get(node, []) if passes(child)), None)
        if match is None:
            return Verdict(path, [node_tokens[n] for n in path], bonus[node + 1])
        path.append(match)
        node = match


@lru_cache(maxsize=256)
def _earlier_siblings(parents: Tuple[int, ...]) -> np.ndarray:
    """[n, n] float: 1 where column is an earlier child of the row's parent."""
    matrix = np.zeros((len(parents), len(parents)), dtype=np.float32)
    for node, parent in enumerate(parents):
        for other in range(node):
            if parents[other] == parent:
                matrix[node, other] = 1.0
    return matrix
