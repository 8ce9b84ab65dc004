"""The losses: EAGLE-3's training-time test (the head unrolled on its own outputs, each
step attending as a tree node of that depth does at inference) and EAGLE-1's feature
regression, on the target's states."""

from __future__ import annotations

from typing import Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from ..target import lm_head, lm_head_rows, target_forward


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


def eagle3_loss(head, target, tokens, mask, features, last, used: mx.array, ttt_steps: int, step_decay: float,
                mask_outside_draft: bool = False):
    """Training-time test; returns (loss, per-step losses, per-step accuracies). The target
    distribution at t is the target's next-token distribution at t + 1, renormalised over
    the draft vocabulary, as EAGLE-3 trains. ``mask_outside_draft``: positions where the
    target's own choice (over its whole vocabulary) is no draft token do not count, since
    no draft can be accepted there (this computes the full LM head once)."""
    target_logits = lm_head_rows(target, shift(last, -1).astype(mx.float32), used)
    wanted = mx.softmax(target_logits, axis=-1)
    target_choice = mx.argmax(target_logits, axis=-1)
    if mask_outside_draft:
        in_draft = mx.zeros((target.args.vocab_size,)).at[used].add(1.0) > 0
        mask = mask & in_draft[mx.argmax(lm_head(target, shift(last, -1)), axis=-1)]
    position = mx.arange(tokens.shape[1])[None]
    total, losses, accuracies = 0.0, [], []
    for step, logits in ttt_unroll(head, target, tokens, features, ttt_steps):
        logprobs = nn.log_softmax(logits, axis=-1)
        valid = mask & (position >= step)  # a step-k draft needs k tokens of context before it
        count = mx.maximum(valid.sum(), 1)
        loss = (-(wanted * logprobs).sum(-1) * valid).sum() / count
        accuracies.append(((mx.argmax(logits, axis=-1) == target_choice) & valid).sum() / count)
        losses.append(loss)
        total = total + (step_decay ** step) * loss
    return total, losses, accuracies


def eagle1_loss(head, target, tokens, mask, features, last):
    """EAGLE-1/2: regress the next feature (smooth L1) + 0.1 x token cross-entropy."""
    features = features.astype(mx.float32)
    out = head.step(target, features, shift(tokens, -1), [KVCache()], 0, "causal")
    count = mx.maximum(mask.sum(), 1)
    regression = (nn.losses.smooth_l1_loss(out, shift(features, -1), reduction="none").mean(-1) * mask).sum() / count
    target_logits = lm_head(target, shift(features, -1)).astype(mx.float32)
    logprobs = nn.log_softmax(lm_head(target, out).astype(mx.float32), axis=-1)
    cross_entropy = (-(mx.softmax(target_logits, axis=-1) * logprobs).sum(-1) * mask).sum() / count
    correct = mx.argmax(logprobs, axis=-1) == mx.argmax(target_logits, axis=-1)
    return regression + 0.1 * cross_entropy, [regression, cross_entropy], [(correct & mask).sum() / count]
