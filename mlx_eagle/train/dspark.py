"""Training a DSpark block drafter (the trained family "dspark", families.py) with the DFlash
trainer's stages (dflash.py: random anchors redrawn every step, every block of a sequence
in one pass under one mask) and DeepSpec's objective. Block position i drafts the token at
anchor + i + 1, its logits the backbone's plus the Markov head's bias from the token
before it (the true one: teacher forcing). Against the target's distribution q and the
draft's p at each position, weighted exp(-i / 4) and counted only while the block's
labels are answer tokens:

    0.1 x cross-entropy(q, p) + 0.9 x |p - q|_1 + 1.0 x BCE(confidence, 1 - |p - q|_1 / 2)

the last term training the confidence head towards the chance that the target accepts
the draft (for greedy drafts, 1 - the total variation between the two)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..dspark_model import DSparkModel, load, new_dspark, save_dspark
from ..errors import UserError
from ..target import lm_head
from .dflash import anchors_of, block_tau, blocks_states
from .ttt import shift

__all__ = ["new_drafter", "loss", "save", "evaluate", "dspark_loss"]
save = save_dspark
DECAY = 4.0  # the published loss_decay_gamma for blocks of 7
WEIGHTS = (0.1, 0.9, 1.0)  # cross-entropy, L1, confidence: the published alphas


def new_drafter(target, config, used: Optional[np.ndarray], init: Optional[Path]) -> DSparkModel:
    """A new drafter for training, in float32 (``init``: one this trainer wrote, to start
    from). Its blocks are filled after their root with ``config.mask_token``."""
    if init is not None:
        model = load(init, target)
        shape = (model.config.block_size, model.config.num_hidden_layers, model.config.markov_rank)
        if shape != (config.block_size, config.dflash_layers, config.markov_rank):
            raise UserError(f"--init {init} has blocks of {shape[0]}, {shape[1]} layers and a Markov rank of "
                            f"{shape[2]}; this run asks for {config.block_size}, {config.dflash_layers} and "
                            f"{config.markov_rank}")
    else:
        mask_token = config.mask_token if config.mask_token is not None else 0
        model = new_dspark(target, config.dflash_layers, config.block_size, mask_token, config.markov_rank,
                           config.seed)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def loss(model, target, tokens, mask, features, last, used, key, config):
    return dspark_loss(model, target, tokens, mask, features, last, key, config.anchors)


def evaluate(target, tokenizer, out: Path, held_out: Sequence[str], config, progress: bool) -> Tuple[dict, str]:
    """Decoded whole blocks (a flat curve), with the confidences' calibration on the held-out prompts."""
    result = block_tau(target, load(out, target), tokenizer, held_out, 64, progress)
    line = (f"held-out tau {result['tau']:.2f} on chains of {config.block_size}, acceptance by block position "
            + " ".join(f"{r:.2f}" for r in result["acceptance_by_position"]))
    if "calibration" in result:
        line += f"; confidence calibration error {result['calibration_error']:.3f} (predicted vs observed: " + \
            ", ".join(f"{band['predicted']:.2f}/{band['observed']:.2f}" for band in result["calibration"]) + ")"
    return result, line


def dspark_loss(model: DSparkModel, target: nn.Module, tokens: mx.array, mask: mx.array, features: mx.array,
                last: mx.array, key: mx.array, anchors: int) -> Tuple[mx.array, List, List]:
    """The published objective (see the module's docstring); returns (loss, [cross-entropy,
    L1, confidence loss], accuracy by block position 0..block - 1). ``mask`` is
    make_batch's (position t counts for token t + 2), ``last`` the target's post-norm
    states (its distributions)."""
    config = model.config
    block, rows, length = config.block_size, tokens.shape[0], tokens.shape[1]
    answer = shift(mask, 2)  # token p is an answer's
    weights = mx.exp(-mx.arange(block) / DECAY)
    terms = [0.0, 0.0, 0.0]
    seen = 0.0
    hits, counts = mx.zeros((block,)), mx.zeros((block,))
    for row, row_key in enumerate(mx.random.split(key, rows)):
        starts = anchors_of(answer[row], min(anchors, length), block, row_key)
        labels = starts[:, None] + mx.arange(1, block + 1)[None]
        valid = mx.cumprod(((labels < length) & answer[row][mx.minimum(labels, length - 1)]).astype(mx.float32),
                           axis=1)  # a block's labels count while they are answer tokens
        labels = mx.minimum(labels, length - 1)
        states = blocks_states(model, target, tokens[row], features[row], starts)
        previous = mx.concatenate([tokens[row][starts][:, None], tokens[row][labels[:, :-1]]], axis=1)
        base = lm_head(target, states).astype(mx.float32)
        carried = model.markov_head.start((starts.shape[0],), states.dtype)
        biases, confidences = [], []
        for i in range(block):
            bias, embedding, carried = model.markov_head.step(previous[:, i], states[:, i], carried)
            biases.append(bias)
            if model.confident:
                confidences.append(model.confidence_logits(states[:, i], embedding))
        logprobs = nn.log_softmax(base + mx.stack(biases, axis=1).astype(mx.float32), axis=-1)
        wanted_logits = lm_head(target, last[row][labels - 1].astype(mx.float32))
        wanted = mx.softmax(wanted_logits, axis=-1)
        distance = mx.abs(mx.exp(logprobs) - wanted).sum(-1)
        weight = weights[None] * valid
        terms[0] = terms[0] + (-(wanted * logprobs).sum(-1) * weight).sum()
        terms[1] = terms[1] + (distance * weight).sum()
        if confidences:
            accept = mx.stop_gradient(mx.clip(1 - distance / 2, 0.0, 1.0))
            logits = mx.stack(confidences, axis=1).astype(mx.float32)
            terms[2] = terms[2] + (nn.losses.binary_cross_entropy(logits, accept, reduction="none") * weight).sum()
        seen = seen + weight.sum()
        hits = hits + ((mx.argmax(logprobs, -1) == mx.argmax(wanted_logits, -1)) & (valid > 0)).sum(0)
        counts = counts + valid.sum(0)
    parts = [term / mx.maximum(seen, 1e-6) for term in terms]
    total = sum(alpha * part for alpha, part in zip(WEIGHTS, parts))
    accuracy = hits / mx.maximum(counts, 1)
    return total, parts, [accuracy[i] for i in range(block)]
