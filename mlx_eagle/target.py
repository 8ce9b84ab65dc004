"""What mlx-lm lacks for EAGLE, written once: attention with per-token positions and
tree masks, the target's forward pass with feature taps, and KV-cache compaction.

These drive the modules of an mlx-lm llama / mistral / qwen2 / qwen3 model directly
(their weights, RoPE and KV caches), since a model's own ``__call__`` only takes one
position offset and builds its own causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import scaled_dot_product_attention

from .cli import UserError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# An int: positions run on from there (prefill, chains). An array: one per token (trees).
Positions = Union[int, mx.array]
# None: one token; "causal": a contiguous block; a bool array [new, cached + new]: a tree.
Mask = Union[None, str, mx.array]


def rotate(rope: nn.Module, x: mx.array, positions: Positions) -> mx.array:
    """RoPE at ``positions``. Per-token positions ride on the batch axis, where
    mx.fast.rope accepts one offset per sequence."""
    if isinstance(positions, int):
        return rope(x, offset=positions)
    return rope(x.transpose(2, 1, 0, 3), offset=positions).transpose(2, 1, 0, 3)


def attention(attn: nn.Module, x: mx.array, cache, positions: Positions, mask: Mask) -> mx.array:
    """An mlx-lm attention module's computation, with our positions and mask."""
    batch, length, _ = x.shape
    queries = attn.q_proj(x).reshape(batch, length, attn.n_heads, -1)
    keys = attn.k_proj(x).reshape(batch, length, attn.n_kv_heads, -1)
    values = attn.v_proj(x).reshape(batch, length, attn.n_kv_heads, -1)
    if "q_norm" in attn:
        queries, keys = attn.q_norm(queries), attn.k_norm(keys)
    queries = rotate(attn.rope, queries.transpose(0, 2, 1, 3), positions)
    keys = rotate(attn.rope, keys.transpose(0, 2, 1, 3), positions)
    keys, values = cache.update_and_fetch(keys, values.transpose(0, 2, 1, 3))
    out = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=attn.scale, mask=mask)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))


def decoder_layer(layer: nn.Module, x: mx.array, cache, positions: Positions, mask: Mask) -> mx.array:
    h = x + attention(layer.self_attn, layer.input_layernorm(x), cache, positions, mask)
    return h + layer.mlp(layer.post_attention_layernorm(h))


@dataclass
class TargetOutput:
    logits: mx.array  # [batch, tokens, vocab]
    features: mx.array  # [batch, tokens, feature width]: what the draft head reads
    hidden: Optional[mx.array] = None  # [batch, tokens, hidden]: the post-norm last state


def check_target(model: nn.Module) -> None:
    model_type = getattr(getattr(model, "args", None), "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(
            f"EAGLE decoding supports {', '.join(SUPPORTED_MODEL_TYPES)} targets, not {model_type!r}; "
            "use mlx_lm for this model"
        )


def lm_head(model: nn.Module, hidden: mx.array) -> mx.array:
    if model.args.tie_word_embeddings:
        return model.model.embed_tokens.as_linear(hidden)
    return model.lm_head(hidden)


def lm_head_rows(model: nn.Module, hidden: mx.array, rows: mx.array) -> mx.array:
    """The LM head's logits for vocabulary ``rows`` only: a draft vocabulary's share of
    the head, without paying for the whole vocabulary."""
    layer = model.model.embed_tokens if model.args.tie_word_embeddings else model.lm_head
    if "scales" in layer:
        biases = layer["biases"][rows] if "biases" in layer else None
        weight = mx.dequantize(layer.weight[rows], layer.scales[rows], biases, layer.group_size, layer.bits,
                               mode=layer.mode)
    else:
        weight = layer.weight[rows]
    logits = hidden @ weight.astype(hidden.dtype).T
    return logits + layer.bias[rows] if "bias" in layer else logits


def target_forward(
    model: nn.Module,
    tokens: mx.array,
    cache: List,
    positions: Positions,
    mask: Mask,
    taps: Optional[Sequence[int]] = None,
) -> TargetOutput:
    """One forward pass over ``tokens`` [batch, n], appending them to ``cache``.

    ``taps`` None returns the post-norm last hidden state (EAGLE-1/2 features);
    otherwise the states entering those layers, concatenated (EAGLE-3).
    """
    inner = model.model
    h = inner.embed_tokens(tokens)
    entering = {}
    for index, (layer, layer_cache) in enumerate(zip(inner.layers, cache)):
        if taps is not None and index in taps:
            entering[index] = h
        h = decoder_layer(layer, h, layer_cache, positions, mask)
    h = inner.norm(h)
    features = h if taps is None else mx.concatenate([entering[i] for i in taps], axis=-1)
    return TargetOutput(logits=lm_head(model, h), features=features, hidden=h)


def tree_mask(cached: int, ancestors: mx.array) -> mx.array:
    """Boolean attention mask for new tokens: every cached entry, then ``ancestors``
    [new, new] (True where a new token may see another: itself and its ancestors)."""
    new = ancestors.shape[0]
    return mx.concatenate([mx.ones((new, cached), dtype=mx.bool_), ancestors], axis=1)


def keep_cache_entries(cache: List, start: int, kept: Sequence[int]) -> None:
    """Keep only the entries at ``start + kept`` (ascending) of the block that begins at
    ``start``, moved down to be contiguous; drop the rest. KVCache.trim only drops
    a suffix, which is not enough once a tree has branched."""
    count = len(kept)
    contiguous = list(kept) == list(range(count))
    if not contiguous:
        source = mx.array([start + k for k in kept])
    for layer_cache in cache:
        if not contiguous:
            layer_cache.keys[..., start:start + count, :] = layer_cache.keys[..., source, :]
            layer_cache.values[..., start:start + count, :] = layer_cache.values[..., source, :]
        layer_cache.trim(max(0, layer_cache.offset - (start + count)))  # as each cache kind rewinds


def default_taps(num_layers: int) -> Tuple[int, int, int]:
    """EAGLE-3's low, middle and high taps: the states entering these layers."""
    return (2, num_layers // 2, num_layers - 3)
