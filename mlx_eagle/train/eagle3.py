"""Training an EAGLE-3 head (the trained family "eagle3", families.py): three tapped
states, a draft vocabulary of its own, trained by training-time test."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..heads import EagleHead, save_head
from ..target import lm_head, lm_head_rows
from .evaluate import evaluate_head as evaluate
from .pieces import d2t_t2d
from .ttt import head_to_train, shift, ttt_unroll

__all__ = ["new_drafter", "loss", "save", "evaluate", "ttt_loss"]
save = save_head


def new_drafter(target, config, used: Optional[np.ndarray], init: Optional[Path]) -> EagleHead:
    """A head that starts speaking the target's output language: its final norm and reduced
    LM head begin as the target's own (the draft vocabulary's rows of it), so training
    spends its steps on prediction rather than on relearning the vocabulary."""
    used = np.arange(target.args.vocab_size) if used is None else used

    def start(head: EagleHead) -> None:
        head.d2t = mx.array(d2t_t2d(used, target.args.vocab_size)[0])
        head.norm.weight = target.model.norm.weight.astype(mx.float32)
        head.lm_head.weight = lm_head_rows(target, mx.eye(target.args.hidden_size), mx.array(used)).T.astype(mx.float32)

    return head_to_train(target, config, used, init, start)


def loss(head, target, tokens, mask, features, last, used, key, config):
    return ttt_loss(head, target, tokens, mask, features, last, used, config.ttt_steps, config.step_decay,
                    config.mask_outside_draft)


def ttt_loss(head, target, tokens, mask, features, last, used: mx.array, ttt_steps: int, step_decay: float,
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
