"""DSpark block drafters' model (DeepSeek's DeepSpec; its Qwen3 layout, as SGLang, vLLM and
llama.cpp read it): DFlash's backbone (dflash_model.py: decoder layers reading the
target's fused states as context, a block [root, mask, ..., mask] drafted in one pass)
with two light heads on the block's final states:

- a Markov head, which makes the block semi-autoregressive: the draft at block position
  i is the argmax of the backbone's logits plus a bias from the token drafted before it,
  ``markov_w2(markov_w1[previous])`` ("vanilla"); "gated" scales that embedding by
  ``sigmoid(gate_proj([state, embedding]))``, and "rnn" carries a small recurrent state
  along the block (``joint_proj``);
- a confidence head, ``sigmoid(proj([state, markov_w1[previous]]))`` (or of the state
  alone): the chance that the target accepts the draft at i once the drafts before it were
  accepted, trained towards 1 - the total variation between the draft's and the target's
  distributions. It becomes each node's ``Proposal.confidence``, so the round verifies only
  the prefix of the block that pays on this device's curve.

Unlike DFlash, block position 0 (the root) drafts too: position i drafts the token at
root + i + 1, so a block of 7 drafts 7 tokens. The published checkpoints carry copies of
the target's embedding and LM head (``embed_tokens``, ``lm_head``); as SGLang does, the
target's own are used and the copies are not loaded (their shapes are checked).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from .dflash_model import (DFlashConfig, DFlashModel, backbone_fields, backbone_json, check_fits, filled,
                           load_checkpoint, new_backbone_fields, write_drafter)
from .errors import UserError
from .target import lm_head

MARKOV_KINDS = ("vanilla", "gated", "rnn")
SHARED = ("embed_tokens.", "lm_head.")  # the target's copies in a published checkpoint


@dataclass
class DSparkConfig(DFlashConfig):
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    confidence_head: bool = True  # enable_confidence_head
    confidence_with_markov: bool = True  # the confidence head also reads markov_w1[previous]
    num_anchors: int = 512  # blocks per sequence in training (the published recipe's)


def dspark_config(raw: dict, source: Path) -> DSparkConfig:
    """The checkpoint's config.json (DeepSpec's: the DSpark fields beside the target's
    Qwen3 ones; or nested in a ``dspark_config``), checked: one line for the first thing
    that is wrong."""
    block = dict(raw, **(raw.get("dspark_config") if isinstance(raw.get("dspark_config"), dict) else {}))
    if "markov_rank" not in block:
        raise UserError(f"{source}: no markov_rank; not a DSpark checkpoint (DeepSpec's config names "
                        "markov_rank, markov_head_type, target_layer_ids and mask_token_id)")
    rank = block["markov_rank"]
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= 1 << 16:
        raise UserError(f"{source}: markov_rank must be an integer from 1 to 65536, not {rank!r} "
                        "(DSpark needs its Markov head)")
    kind = str(block.get("markov_head_type", "vanilla")).lower()
    if kind not in MARKOV_KINDS:
        raise UserError(f"{source}: markov_head_type {kind!r} is not one of {', '.join(MARKOV_KINDS)}")
    confidence = block.get("enable_confidence_head", True) is not False
    with_markov = block.get("confidence_head_with_markov", True) is not False
    anchors = block.get("num_anchors", 512)
    return DSparkConfig(**backbone_fields(raw, block, source, "", lowest_layer=-1, default_block=7),
                        markov_rank=rank, markov_head_type=kind, confidence_head=confidence,
                        confidence_with_markov=confidence and with_markov,
                        num_anchors=anchors if isinstance(anchors, int) and anchors > 0 else 512)


class MarkovHead(nn.Module):
    """The bias a draft gets from the token before it (DeepSpec's VanillaMarkov, and its
    gated and recurrent variants), under the published names."""

    def __init__(self, vocab: int, rank: int, hidden: int, kind: str):
        super().__init__()
        self.kind = kind
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def start(self, shape: Tuple[int, ...], dtype: mx.Dtype) -> Optional[mx.array]:
        """The recurrent state before a block's first position (None: no state)."""
        return mx.zeros(shape + (self.markov_w1.weight.shape[1],), dtype=dtype) if self.kind == "rnn" else None

    def step(self, previous: mx.array, state: mx.array, carried: Optional[mx.array]) -> Tuple[mx.array, mx.array,
                                                                                                 Optional[mx.array]]:
        """For drafts after the tokens ``previous`` [...] at block states ``state`` [..., hidden]:
        (the logits' bias [..., vocab], markov_w1[previous], the recurrent state after)."""
        embedding = self.markov_w1(previous).astype(state.dtype)
        if self.kind == "vanilla":
            return self.markov_w2(embedding), embedding, None
        if self.kind == "gated":
            gate = mx.sigmoid(self.gate_proj(mx.concatenate([state, embedding], axis=-1)))
            return self.markov_w2(gate * embedding), embedding, None
        gate, candidate, output = mx.split(self.joint_proj(mx.concatenate([carried, embedding, state], axis=-1)),
                                           3, axis=-1)
        gate = mx.sigmoid(gate)
        carried = gate * carried + (1 - gate) * mx.tanh(candidate)
        return self.markov_w2(mx.tanh(output)), embedding, carried


class ConfidenceHead(nn.Module):
    """DeepSpec's AcceptRatePredictor: one linear map to a logit."""

    def __init__(self, features: int):
        super().__init__()
        self.proj = nn.Linear(features, 1)

    def __call__(self, features: mx.array) -> mx.array:
        return self.proj(features)[..., 0]


class DSparkModel(DFlashModel):
    """The drafter's weights, under DeepSpec's names (the backbone's are DFlash's)."""

    def __init__(self, config: DSparkConfig, target_hidden: int):
        super().__init__(config, target_hidden)
        self.markov_head = MarkovHead(config.vocab_size, config.markov_rank, config.hidden_size,
                                      config.markov_head_type)
        if config.confidence_head:
            self.confidence_head = ConfidenceHead(
                config.hidden_size + (config.markov_rank if config.confidence_with_markov else 0))

    @property
    def confident(self) -> bool:
        return "confidence_head" in self

    def confidence_logits(self, state: mx.array, embedding: mx.array) -> mx.array:
        features = mx.concatenate([state, embedding], axis=-1) if self.config.confidence_with_markov else state
        return self.confidence_head(features)

    def draft_blocks(self, target: nn.Module, rows: Sequence[Tuple[int, List[KVCache], int]]
                     ) -> Tuple[mx.array, Optional[mx.array]]:
        """Several conversations' blocks (root token, cache, the root's position: the block
        after that cache's context) in one pass, drafted greedily left to right: (tokens
        [rows, block], each one's confidence [rows, block], or None without a confidence
        head), still on the device."""
        config = self.config
        states = self.blocks_states(target, rows)
        base = lm_head(target, states)
        previous = mx.array([root for root, _, _ in rows])
        carried = self.markov_head.start((len(rows),), states.dtype)
        tokens, confidences = [], []
        for i in range(config.block_size):
            bias, embedding, carried = self.markov_head.step(previous, states[:, i], carried)
            previous = mx.argmax(base[:, i] + bias.astype(base.dtype), axis=-1).astype(mx.int32)
            tokens.append(previous)
            if self.confident:
                confidences.append(self.confidence_logits(states[:, i], embedding))
        confidence = mx.sigmoid(mx.stack(confidences, axis=1).astype(mx.float32)) if confidences else None
        return mx.stack(tokens, axis=1), confidence


def recognizes(path: Path, config: Optional[dict]) -> bool:
    """A DSpark checkpoint: its config names a DSpark architecture or gives a markov_rank."""
    return config is not None and ("markov_rank" in config or "dspark_config" in config or any(
        isinstance(a, str) and "dspark" in a.lower() for a in config.get("architectures") or []))


def load(directory: Path, model: nn.Module) -> DSparkModel:
    """The checkpoint in ``directory`` for the target ``model``, checked against it."""
    return load_checkpoint(directory, model, build, "a DSpark checkpoint")


def build(raw: dict, weights: Dict[str, mx.array], model: nn.Module, source) -> DSparkModel:
    """The drafter holding a checkpoint's ``weights`` (its config.json: ``raw``), checked
    against the target ``model``; the target's embedding and LM head stand for the copies a
    published checkpoint carries."""
    config = dspark_config(raw, source)
    check_fits(config, model, Path(source).parent, "DSpark")
    weights = dict(weights)
    shape = (config.vocab_size, config.hidden_size)
    for name in [name for name in weights if name.removeprefix("model.").startswith(SHARED)]:
        copy = weights.pop(name)
        if name.endswith(".weight") and mx.issubdtype(copy.dtype, mx.floating) and tuple(copy.shape) != shape:
            raise UserError(f"{Path(source).parent}: {name} is {tuple(copy.shape)}, not the target's {shape}")
    return filled(DSparkModel(config, model.args.hidden_size), raw, weights, model, source)


def new_dspark(target: nn.Module, layers: int = 5, block_size: int = 7, mask_token_id: int = 0,
               markov_rank: int = 256, seed: int = 0) -> DSparkModel:
    """A randomly initialised drafter shaped for ``target`` (for training, and for tests),
    with a vanilla Markov head and a confidence head reading it, as published."""
    config = DSparkConfig(**new_backbone_fields(target, layers, block_size, mask_token_id),
                          markov_rank=markov_rank)
    check_fits(config, target, "a new drafter", "DSpark")
    mx.random.seed(seed)
    model = DSparkModel(config, target.args.hidden_size)
    mx.eval(model.parameters())
    return model


def save_dspark(model: DSparkModel, path: Path, dtype: Optional[mx.Dtype] = None) -> None:
    """Write config.json and model.safetensors in DeepSpec's layout (``dtype``: the
    weights'), without the copies of the target's embedding and LM head."""
    config = model.config
    raw: Dict[str, Any] = dict(
        backbone_json(config), architectures=["Qwen3DSparkModel"], block_size=config.block_size,
        target_layer_ids=list(config.target_layer_ids), mask_token_id=config.mask_token_id,
        num_anchors=config.num_anchors, markov_rank=config.markov_rank, markov_head_type=config.markov_head_type,
        enable_confidence_head=config.confidence_head)
    if config.confidence_head:
        raw["confidence_head_with_markov"] = config.confidence_with_markov
    write_drafter(model, raw, path, dtype)
