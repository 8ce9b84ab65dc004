"""DFlash's training objective, as published (arXiv 2602.06036; SpecForge's recipe): each
sequence gets random anchor positions, redrawn every step; at each anchor a block [the
anchor's token, mask, ..., mask] attends to the fused target states before the anchor and,
bidirectionally, to its own block, all blocks of a sequence in one pass under one mask.
Block position i is trained towards the target's distribution for the token at anchor + i,
weighted exp(-(i - 1) / gamma), so that the first drafts, which every accepted run starts
with, count most."""

from __future__ import annotations

from typing import List, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..drafters.dflash import DFlashModel
from ..target import embed, lm_head
from .ttt import shift


def decay(block_size: int) -> float:
    """The published gamma: 7 for blocks of 16, 5 for 10, 4 for 8."""
    return 7.0 if block_size >= 16 else 5.0 if block_size >= 10 else 4.0


def anchors_of(answer: mx.array, count: int, block: int, key: mx.array) -> mx.array:
    """``count`` random positions of one sequence whose next token is an answer's (any
    others only where there are fewer such: their labels do not count)."""
    eligible = shift(answer[None], -1)[0]  # the block's first draft (anchor + 1) is an answer token
    scores = mx.random.uniform(shape=answer.shape, key=key) + 2.0 * eligible
    return mx.sort(mx.argsort(-scores)[:count])


def block_mask(anchors: mx.array, length: int, block: int, causal: bool) -> mx.array:
    """[anchors x block, length + anchors x block]: a block sees the context before its
    anchor, and its own block (all of it, or up to itself where the layers are causal)."""
    count = anchors.shape[0]
    anchor = mx.repeat(anchors, block)[:, None]
    context = mx.arange(length)[None] < anchor
    own = mx.repeat(mx.arange(count), block)
    same = own[:, None] == own[None]
    if causal:
        offset = mx.tile(mx.arange(block), count)
        same = same & (offset[None] <= offset[:, None])
    return mx.concatenate([context, same], axis=1)


def blocks_logits(model: DFlashModel, target: nn.Module, tokens: mx.array, features: mx.array,
                  starts: mx.array) -> mx.array:
    """One sequence's blocks at the anchors ``starts`` in one pass: logits [anchors,
    block - 1, vocab] for positions anchor + 1.., each block seeing the context before its
    anchor, as it would drafting there (``tokens`` [length], ``features`` [length, taps x hidden])."""
    config = model.config
    block, length = config.block_size, tokens.shape[0]
    positions = starts[:, None] + mx.arange(block)[None]
    ids = mx.where(mx.arange(block)[None] == 0, tokens[starts][:, None], config.mask_token_id)
    h = embed(target, ids.reshape(1, -1)).astype(mx.float32)
    context = model.context(features[None].astype(mx.float32))
    attend = block_mask(starts, length, block, bool(config.is_causal))
    for layer in model.layers:
        h = layer(h, layer.self_attn.keys_values(context, mx.array(0)), positions.reshape(-1), attend)
    return lm_head(target, model.norm(h).reshape(starts.shape[0], block, -1)[:, 1:]).astype(mx.float32)


def dflash_loss(model: DFlashModel, target: nn.Module, tokens: mx.array, mask: mx.array, features: mx.array,
                last: mx.array, key: mx.array, anchors: int, gamma: float) -> Tuple[mx.array, List, List]:
    """The weighted cross-entropy against the target's distributions; returns (loss, [loss],
    accuracy by block position 1..block - 1). ``mask`` is make_batch's (position t counts
    for token t + 2), ``last`` the target's post-norm states (its distributions)."""
    block, rows, length = model.config.block_size, tokens.shape[0], tokens.shape[1]
    answer = shift(mask, 2)  # token p is an answer's
    weights = mx.exp(-mx.arange(block - 1) / gamma)
    total, seen = 0.0, 0.0
    hits, counts = mx.zeros((block - 1,)), mx.zeros((block - 1,))
    for row, row_key in enumerate(mx.random.split(key, rows)):
        starts = anchors_of(answer[row], min(anchors, length), block, row_key)
        labels = starts[:, None] + mx.arange(1, block)[None]
        valid = (labels < length) & answer[row][mx.minimum(labels, length - 1)]
        labels = mx.minimum(labels, length - 1)
        logprobs = nn.log_softmax(blocks_logits(model, target, tokens[row], features[row], starts), axis=-1)
        wanted_logits = lm_head(target, last[row][labels - 1].astype(mx.float32))
        cross_entropy = -(mx.softmax(wanted_logits, axis=-1) * logprobs).sum(-1)
        weight = weights[None] * valid
        total = total + (cross_entropy * weight).sum()
        seen = seen + weight.sum()
        hits = hits + ((mx.argmax(logprobs, -1) == mx.argmax(wanted_logits, -1)) & valid).sum(0)
        counts = counts + valid.sum(0)
    loss = total / mx.maximum(seen, 1e-6)
    accuracy = hits / mx.maximum(counts, 1)
    return loss, [loss], [accuracy[i] for i in range(block - 1)]
