"""What training an EAGLE head needs, whichever its family: the target's states it reads,
a head to start from, and training-time test (the head unrolled on its own outputs, each
step attending as a tree node of that depth does at inference), which EAGLE-3 trains with
and acceptance is measured by."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache
from mlx_lm.utils import dequantize_model

from ..errors import UserError
from ..heads import EagleHead, load_head, new_head
from ..target import target_forward


def target_states(target, tokens: mx.array, taps: Optional[Sequence[int]]) -> Tuple[mx.array, mx.array]:
    """What a head trains on, computed afresh for each batch: the tapped states (EAGLE-3;
    the last state for EAGLE-1) and the post-norm last state, which gives the target's
    probabilities. The full-vocabulary logits are never evaluated, so never computed."""
    out = target_forward(target, tokens, [KVCache() for _ in target.model.layers], 0, "causal", taps)
    return mx.stop_gradient(out.features), mx.stop_gradient(out.hidden)


def shift(x: mx.array, by: int) -> mx.array:
    """Move along the sequence axis by ``by`` (>0: right), filling with zeros."""
    zeros = mx.zeros_like(x[:, :abs(by)])
    return mx.concatenate([zeros, x[:, :-by]], axis=1) if by > 0 else mx.concatenate([x[:, -by:], zeros], axis=1)


class TTTCache:
    """The head's keys and values across training-time-test steps, attending as a tree
    node of each depth does at inference without forming that mask: step k's query at
    position t sees step 0's keys up to t - k (the committed context) and, from each
    later step j, only the key at t - k + j (its own ancestor). It scores L + k keys
    where a dense [L, (k + 1) L] mask would score (k + 1) L, which at TTT 5 over 2,048
    tokens is most of the head's work. target.layer_block asks a cache with ``attend``
    for the attention."""

    def __init__(self):
        self.keys: List[mx.array] = []
        self.values: List[mx.array] = []

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Tuple[mx.array, mx.array]:
        self.keys.append(keys)
        self.values.append(values)
        return keys, values

    def attend(self, queries: mx.array, scale: float) -> mx.array:
        step = len(self.keys) - 1
        if step == 0:
            return mx.fast.scaled_dot_product_attention(queries, self.keys[0], self.values[0], scale=scale,
                                                        mask="causal")
        batch, heads, length, width = queries.shape
        kv_heads = self.keys[0].shape[1]
        grouped = (queries * scale).reshape(batch, kv_heads, heads // kv_heads, length, width)
        t = mx.arange(length)
        context = grouped @ self.keys[0][:, :, None].swapaxes(-1, -2)  # [batch, kv, group, L, L]
        scores = [mx.where(t[None] <= t[:, None] - step, context, -mx.inf)]
        # Step j's key for the query at t sits at t - (step - j): moved right by step - j.
        ancestors = [(shift_positions(self.keys[j], step - j), shift_positions(self.values[j], step - j))
                     for j in range(1, step + 1)]
        for j, (keys, _) in enumerate(ancestors, start=1):
            score = (grouped * keys[:, :, None]).sum(-1, keepdims=True)
            scores.append(mx.where((t >= step - j)[:, None], score, -mx.inf))
        weights = mx.softmax(mx.concatenate(scores, axis=-1), axis=-1, precise=True)
        out = weights[..., :length] @ self.values[0][:, :, None]
        for j, (_, values) in enumerate(ancestors, start=1):
            out = out + weights[..., length + j - 1:length + j] * values[:, :, None]
        return out.reshape(batch, heads, length, width)


def shift_positions(x: mx.array, by: int) -> mx.array:
    """[batch, heads, length, width] moved ``by`` positions later, zeros first."""
    return mx.concatenate([mx.zeros_like(x[:, :, :by]), x[:, :, :x.shape[2] - by]], axis=2) if by else x


def ttt_unroll(head, target, tokens: mx.array, features: mx.array, steps: int) -> Iterator[Tuple[int, mx.array]]:
    """Training-time test: the head unrolled ``steps`` times on its own outputs. Yields
    (step, the head's logits [batch, length, draft vocab]). Step k at position t predicts
    token t + 2 as a depth-(k + 1) tree node does: true tokens up to t + 1, the target's
    features only up to t - k, the head's own outputs after that (see TTTCache)."""
    next_tokens = shift(tokens, -1)
    cache = [TTTCache()]
    hidden = head.project(features.astype(mx.float32))
    for step in range(steps):
        out = head.step(target, hidden, next_tokens, cache, 0, None)
        yield step, head.logits(target, out).astype(mx.float32)
        hidden = shift(out, 1)  # position t next reads the head's own output at t - 1


def same_draft_vocabulary(head: nn.Module, weights: Iterable[Tuple[str, mx.array]]) -> bool:
    """Whether ``weights`` (a checkpoint's) hold the integer tensors ``head`` holds: those map
    a draft vocabulary, chosen by the data, never trained."""
    own = dict(tree_flatten(head.parameters()))
    return all(mx.issubdtype(value.dtype, mx.floating) or name not in own
               or np.array_equal(np.array(value), np.array(own[name])) for name, value in weights)


def head_to_train(target, config, used: Optional[np.ndarray], init: Optional[Path],
                  start: Optional[Callable[[EagleHead], None]] = None) -> EagleHead:
    """A new head of ``config.family`` for training, in float32 whatever the target's dtype
    (a bfloat16 or quantized target on a GPU would otherwise give a bfloat16 head to AdamW).
    ``start`` sets the family's own starting weights. ``config.train_embeddings``: the head
    gets an embedding of its own, a copy of the target's, which training moves. ``init``: a
    head this trainer wrote before, whose weights it starts from; its integer tensors (a
    draft vocabulary's map) must equal the new head's."""
    head = new_head(target, config.family, draft_vocab_size=None if used is None else len(used), seed=config.seed)
    if config.train_embeddings:
        vocab = target.args.vocab_size
        head.embed_tokens = nn.Embedding(vocab, target.args.hidden_size)
        head.embed_tokens.weight = target.model.embed_tokens(mx.arange(vocab)).astype(mx.float32)
    head.set_dtype(mx.float32)
    if start is not None:
        start(head)
    if init is not None:  # a quantized head (as shipped) is widened first
        weights = tree_flatten(dequantize_model(load_head(init, target)).parameters())
        if not same_draft_vocabulary(head, weights):
            raise UserError(f"--init {init} drafts from another draft vocabulary than this run's")
        try:
            head.load_weights([(k, v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v)
                               for k, v in weights])
        except ValueError as exc:
            raise UserError(f"--init {init} is not a {config.family} head for this target ({str(exc)[:80]})") from None
    return head
