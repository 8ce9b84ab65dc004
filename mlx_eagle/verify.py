"""Accepting draft tokens so the output is exactly the target's own.

Every position's token is the target's choice there, made from randomness fixed by the
position alone: greedy, the argmax of the target's logits; sampling, the argmax of its
log-probabilities (after temperature, top-p, min-p, top-k, as mlx-lm's sampler applies
them) plus Gumbel noise drawn from (seed, position) (Gumbel-max: an exact draw from that
distribution). A drafted child is accepted when it equals its parent's choice; the walk
ends with the choice of the position where no child equals it (the bonus token). So the
text is the one plain decoding with the same seed writes, token for token, whatever was
drafted, whichever conversations shared the pass and whatever came before: a seed
reproduces its reply. A deterministic draft x is accepted with probability p(x), and a
node's children together with the sum of theirs, as multi-draft rejection sampling
accepts them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
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
                raise UserError(f"{name} must be a finite number, not {value!r}", name)
        if self.temp < 0:
            raise UserError(f"temp must be 0 (greedy) or more, not {self.temp}", "temp")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be above 0 and at most 1 (1: no top-p), not {self.top_p}", "top_p")
        if not 0 <= self.min_p <= 1:
            raise UserError(f"min_p must be from 0 (no min-p) to 1, not {self.min_p}", "min_p")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise UserError(f"top_k must be a whole number, 0 (no top-k) or more, not {self.top_k!r}", "top_k")

    @property
    def greedy(self) -> bool:
        """Greedy decoding: temp 0, or settings too small to compute (see MIN_TEMPERATURE)."""
        return self.temp < MIN_TEMPERATURE or self.top_p < MIN_TOP_P

    def scores(self, logits: mx.array) -> mx.array:
        """Log-probabilities up to a constant per row, of the distribution mlx-lm's
        make_sampler(temp, top_p, min_p, top_k=...) samples from (-inf: left out)."""
        logprobs = logits.astype(mx.float32)
        logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
        if 0 < self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p != 0.0:
            logprobs = apply_min_p(logprobs, self.min_p)
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        return logprobs * (1.0 / self.temp)

    def probabilities(self, logits: mx.array) -> mx.array:
        """That distribution."""
        return mx.softmax(self.scores(logits), axis=-1)

    def choices(self, logits: mx.array, seed: int, positions: Sequence[int],
                tolerance: float = 0.0) -> Tuple[mx.array, Optional[mx.array]]:
        """Each row's token (row i chooses the token at ``positions[i]``), on the device, and
        with ``tolerance`` > 0 whether the row's choice lay within it of its runner-up: a
        choice another kernel's rounding of the logits by up to ``tolerance`` could flip."""
        if self.greedy:
            scores = logits
        else:
            scores = self.scores(logits) + gumbel_noise(seed, positions, logits.shape[-1])
            tolerance *= 2.0 / self.temp  # (the log-softmax moves by up to twice what its logits do)
        close = too_close(scores, tolerance) if tolerance > 0 else None
        return mx.argmax(scores, axis=-1), close


@dataclass
class Verdict:
    path: List[int]  # accepted node indices, root's child first
    tokens: List[int]  # their tokens
    bonus: int  # the target's own next token after them
    # The position after the path had its top two scores closer than the block's tolerance,
    # so ``bonus`` may not be what plain decoding picks: decide it with one row.
    unsure: bool = False


# Gumbel noise from (seed, position, token): a counter-based hash, the same on every device
# and in every batch, vectorized over the vocabulary (murmur3's finalizer, twice).
_MIX1, _MIX2, _GOLDEN = 0x85EBCA6B, 0xC2B2AE35, 0x9E3779B9
_MASK64 = (1 << 64) - 1


def _splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def _fmix32(h: mx.array) -> mx.array:
    h = (h ^ (h >> 16)) * _MIX1
    h = (h ^ (h >> 13)) * _MIX2
    return h ^ (h >> 16)


@mx.compile
def _gumbel(keys: mx.array, token_ids: mx.array) -> mx.array:
    bits = _fmix32(_fmix32((token_ids[None, :] * _GOLDEN) ^ keys[:, :1]) ^ keys[:, 1:])
    uniform = ((bits >> 9).astype(mx.float32) + 0.5) * (1.0 / (1 << 23))  # in (0, 1)
    return -mx.log(-mx.log(uniform))


def gumbel_noise(seed: int, positions: Sequence[int], vocab: int) -> mx.array:
    """[len(positions), vocab] standard Gumbel noise, a function of (seed, position, token)
    alone, computed once per distinct position."""
    distinct = sorted(set(positions))
    streams = [_splitmix64(_splitmix64(seed & _MASK64) ^ position) for position in distinct]
    keys = mx.array([[stream & 0xFFFFFFFF, stream >> 32] for stream in streams], dtype=mx.uint32)
    noise = _gumbel(keys, mx.arange(vocab, dtype=mx.uint32))
    if len(distinct) == len(positions) and distinct == list(positions):
        return noise
    return noise[mx.array([distinct.index(position) for position in positions])]


def accept(tree: DraftTree, tokens: mx.array, logits: mx.array, sampling: Sampling, seed: int = 0,
           first: int = 0, tolerance: float = 0.0) -> Verdict:
    """Walk the tree from the root. ``tokens`` [n]: the nodes' tokens; ``logits``
    [1 + n, vocab]: the target's at the root, then at each node; ``seed``: the reply's, for
    sampling; ``first``: the position of the token chosen at the root (a node's row chooses
    the one after its parent's); ``tolerance``: how close two logits of one block row may
    come before the row's choice is left to a one-row pass (Verdict.unsure; 0: trusted as
    computed).

    Everything vocabulary-sized stays on the device; one read brings back what the walk
    needs: each row's choice. Token ids the drafter may have left unchecked on the device
    (drafters/admit.py) are safe here: an id outside the vocabulary is never any row's
    choice, and a sibling repeating an earlier one is never reached (the first matched)."""
    positions = [first]
    for parent in tree.parents:  # (the depths as the parents say, whatever the tree carries)
        positions.append(positions[parent + 1] + 1)
    choice, close = sampling.choices(logits, seed, positions, tolerance)
    mx.eval(choice, tokens, *([close] if close is not None else []))
    choice, node_tokens = choice.tolist(), tokens.tolist()
    return _walk(tree, node_tokens, choice, close.tolist() if close is not None else None)


def too_close(scores: mx.array, tolerance: float) -> mx.array:
    """Per row of ``scores``, whether its top two lie within ``tolerance``: a choice that
    another kernel's rounding could flip."""
    top = mx.topk(scores, 2, axis=-1).astype(mx.float32)
    return mx.abs(top[..., 0] - top[..., 1]) <= tolerance


def _walk(tree: DraftTree, node_tokens: List[int], choice: List[int], close: Optional[List[bool]]) -> Verdict:
    """From the root into the first child equal to its parent's choice, while one is; then
    the choice of the position where the walk ended (``choice[0]``: the root's), the bonus
    token. A position whose row is ``close`` ends the walk there, unsure."""
    children = tree.children()
    path, node = [], -1
    while True:
        if close is not None and close[node + 1]:
            return Verdict(path, [node_tokens[n] for n in path], choice[node + 1], unsure=True)
        match = next((child for child in children.get(node, []) if node_tokens[child] == choice[node + 1]), None)
        if match is None:
            return Verdict(path, [node_tokens[n] for n in path], choice[node + 1])
        path.append(match)
        node = match
