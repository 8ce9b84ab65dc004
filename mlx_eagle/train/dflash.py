"""Training a DFlash block drafter (the trained family "dflash", families.py). Its
objective, as published (arXiv 2602.06036; SpecForge's recipe): each
sequence gets random anchor positions, redrawn every step; at each anchor a block [the
anchor's token, mask, ..., mask] attends to the fused target states before the anchor and,
bidirectionally, to its own block, all blocks of a sequence in one pass under one mask.
Block position i is trained towards the target's distribution for the token at anchor + i,
weighted exp(-(i - 1) / gamma), so that the first drafts, which every accepted run starts
with, count most."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..decoder import SpeculativeDecoder
from ..dflash_model import DFlashModel, load, new_dflash, save_dflash
from ..drafters.dflash import DFlashDrafter
from ..drafters.dspark import Calibration, DSparkDrafter
from ..dspark_model import DSparkModel
from ..errors import UserError
from ..replies import chat_tokens
from ..progress import progress_bar
from ..target import embed, lm_head
from ..verify import Sampling
from .ttt import shift

__all__ = ["new_drafter", "loss", "save", "evaluate", "block_loss", "blocks_logits", "blocks_states", "block_tau",
           "anchors_of", "decay"]
save = save_dflash


def new_drafter(target, config, used: Optional[np.ndarray], init: Optional[Path]) -> DFlashModel:
    """A new drafter for training, in float32 (``init``: one this trainer wrote, to start
    from). Its blocks are filled after their root with ``config.mask_token``."""
    if init is not None:
        model = load(init, target)
        block, layers = model.config.block_size, model.config.num_hidden_layers
        if (block, layers) != (config.block_size, config.dflash_layers):
            raise UserError(f"--init {init} has blocks of {block} and {layers} layers; this run asks for "
                            f"{config.block_size} and {config.dflash_layers}")
    else:
        mask_token = config.mask_token if config.mask_token is not None else 0
        model = new_dflash(target, config.dflash_layers, config.block_size, mask_token, config.seed)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def loss(model, target, tokens, mask, features, last, used, key, config):
    return block_loss(model, target, tokens, mask, features, last, key, config.anchors, decay(config.block_size))


def evaluate(target, tokenizer, out: Path, held_out: Sequence[str], config, progress: bool) -> Tuple[dict, str]:
    """Decoded, not unrolled: a block's drafts depend on the whole block, not a path to them."""
    result = block_tau(target, load(out, target), tokenizer, held_out, 64, progress)
    return result, (f"held-out tau {result['tau']:.2f} on chains of {config.block_size - 1}, acceptance by block "
                    "position " + " ".join(f"{r:.2f}" for r in result["acceptance_by_position"]))


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
    return lm_head(target, blocks_states(model, target, tokens, features, starts)[:, 1:]).astype(mx.float32)


def blocks_states(model: DFlashModel, target: nn.Module, tokens: mx.array, features: mx.array,
                  starts: mx.array) -> mx.array:
    """The final (normed) states [anchors, block, hidden] of one sequence's blocks at the
    anchors ``starts``, in one pass (see ``blocks_logits``)."""
    config = model.config
    block, length = config.block_size, tokens.shape[0]
    positions = starts[:, None] + mx.arange(block)[None]
    ids = mx.where(mx.arange(block)[None] == 0, tokens[starts][:, None], config.mask_token_id)
    h = embed(target, ids.reshape(1, -1)).astype(mx.float32)
    context = model.context(features[None].astype(mx.float32))
    attend = block_mask(starts, length, block, bool(config.is_causal))
    for layer in model.layers:
        h = layer(h, [layer.self_attn.keys_values(context, mx.array(0))], positions.reshape(-1), [attend],
                  [0, h.shape[1]])
    return model.norm(h).reshape(starts.shape[0], block, -1)


def block_loss(model: DFlashModel, target: nn.Module, tokens: mx.array, mask: mx.array, features: mx.array,
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


def block_tau(model: nn.Module, drafter: DFlashModel, tokenizer, prompts: Sequence[str], max_tokens: int,
              progress: bool = False) -> Dict[str, object]:
    """A block drafter's tau on whole chains (block - 1 drafts for DFlash, block for DSpark,
    as a flat cost curve sizes them), greedy, over the held-out prompts, and its acceptance
    by block position; for a DSpark drafter with a confidence head, its calibration too:
    predicted against observed acceptance by band of confidence (``Calibration.table``)."""
    generated = rounds = 0
    tried = accepted = 0
    calibration = Calibration()
    for prompt in progress_bar(prompts, desc="held-out tau", unit="prompt", disable=not progress):
        ids = chat_tokens(tokenizer, [{"role": "user", "content": prompt}])
        chains = DSparkDrafter(drafter, model, lambda tokens: 1.0) if isinstance(drafter, DSparkModel) else \
            DFlashDrafter(drafter, model, lambda tokens: 1.0, trees=False)
        decoder = SpeculativeDecoder(model, chains, Sampling())
        tokens = [decoder.prefill(ids)]
        while len(tokens) < max_tokens and tokens[-1] not in tokenizer.eos_token_ids:
            tokens += decoder.round(max_tokens - len(tokens)).tokens
            rounds += 1
        generated += len(tokens) - 1
        tried, accepted = tried + chains.tried[0], accepted + chains.accepted[0]
        if isinstance(chains, DSparkDrafter):
            calibration.merge(chains.calibration)
    result = {"tau": generated / max(rounds, 1), "acceptance_by_position": [float(a) for a in accepted / np.maximum(
        tried, 1)], "rounds": rounds, "prompts": len(prompts)}
    if calibration.count.sum():
        result["calibration"] = calibration.table()
        result["calibration_error"] = calibration.error()
    return result
