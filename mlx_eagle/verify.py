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

from dataclasses import dataclass
from typing import List, Optional, Tuple

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from .trees import DraftTree


@dataclass
class Sampling:
    temp: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temp == 0

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


def accept(tree: DraftTree, logits: mx.array, sampling: Sampling,
           rng: Optional[np.random.Generator]) -> Tuple[List[int], int]:
    """Walk the tree from the root. ``logits`` [1 + n, vocab]: the target's at the root,
    then at each node. Returns (accepted node indices, bonus token)."""
    children = tree.children()
    if sampling.greedy:
        choice = np.array(mx.argmax(logits, axis=-1))
        path, node = [], -1
        while True:
            wanted = int(choice[node + 1])
            match = next((c for c in children.get(node, []) if tree.tokens[c] == wanted), None)
            if match is None:
                return path, wanted
            path.append(match)
            node = match
    probs = np.array(sampling.probabilities(logits)).astype(np.float64)
    path, node = [], -1
    while True:
        p = probs[node + 1]
        accepted = None
        for child in children.get(node, []):
            token = tree.tokens[child]
            mass = p.sum()
            if rng.random() * mass < p[token]:
                accepted = child
                break
            p[token] = 0.0
        if accepted is None:
            return path, int(rng.choice(p.shape[0], p=p / p.sum()))
        path.append(accepted)
        node = accepted
