"""Training an EAGLE-1/2 head (the trained family "eagle1", families.py): it reads the
target's last state and drafts through the target's LM head, trained to regress the next
state."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache

from ..heads import EagleHead, save_head
from ..target import lm_head
from .evaluate import evaluate_head as evaluate
from .ttt import head_to_train, shift

__all__ = ["new_drafter", "loss", "save", "evaluate"]
save = save_head


def new_drafter(target, config, used: Optional[np.ndarray], init: Optional[Path]) -> EagleHead:
    return head_to_train(target, config, None, init)


def loss(head, target, tokens, mask, features, last, used, key, config):
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
