"""What mlx-lm lacks for EAGLE, written once: attention with per-token positions and
tree masks, the target's forward pass with feature taps, and KV-cache compaction.

These drive the modules of an mlx-lm llama / mistral / qwen2 / qwen3 model directly
(their weights, RoPE and KV caches), since a model's own ``__call__`` only takes one
position offset and builds its own causal mask.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import partial
from typing import Callable, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import scaled_dot_product_attention

from .errors import UserError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_MLX_LM_MODULES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}  # mlx-lm runs mistral as llama


def model_classes(model_type: str) -> Tuple[type, type]:
    """mlx-lm's (Model, ModelArgs) for a supported model type, from its public modules."""
    if model_type not in _MLX_LM_MODULES:
        raise UserError(f"model type {model_type!r} is not supported; supported are {', '.join(SUPPORTED_MODEL_TYPES)}")
    module = importlib.import_module(f"mlx_lm.models.{_MLX_LM_MODULES[model_type]}")
    return module.Model, module.ModelArgs

# An int: positions run on from there (prefill, chains). An array: one per token (trees).
Positions = Union[int, mx.array]
# None: one token; "causal": a contiguous block; a bool array [new, cached + new]: a tree.
Mask = Union[None, str, mx.array]


def rotate(rope: nn.Module, x: mx.array, positions: mx.array) -> mx.array:
    """RoPE at ``positions``: a scalar (positions run on from there) or one per token,
    which rides on the batch axis, where mx.fast.rope accepts one offset per sequence."""
    if positions.ndim == 0:
        return rope(x, offset=positions)
    return rope(x.transpose(2, 1, 0, 3), offset=positions).transpose(2, 1, 0, 3)


def _project(attn: nn.Module, x: mx.array, positions: mx.array) -> Tuple[mx.array, mx.array, mx.array]:
    """An mlx-lm attention module's queries, keys and values for ``x``, rotated."""
    batch, length, _ = x.shape
    queries = attn.q_proj(x).reshape(batch, length, attn.n_heads, -1)
    keys = attn.k_proj(x).reshape(batch, length, attn.n_kv_heads, -1)
    values = attn.v_proj(x).reshape(batch, length, attn.n_kv_heads, -1)
    if "q_norm" in attn:
        queries, keys = attn.q_norm(queries), attn.k_norm(keys)
    queries = rotate(attn.rope, queries.transpose(0, 2, 1, 3), positions)
    keys = rotate(attn.rope, keys.transpose(0, 2, 1, 3), positions)
    return queries, keys, values.transpose(0, 2, 1, 3)


def _finish(layer: nn.Module, residual: mx.array, attended: mx.array) -> mx.array:
    """The rest of a decoder layer after attention: output projection, residual, MLP."""
    batch, _, length, _ = attended.shape
    h = residual + layer.self_attn.o_proj(attended.transpose(0, 2, 1, 3).reshape(batch, length, -1))
    return h + layer.mlp(layer.post_attention_layernorm(h))


# Blocks up to this many tokens (decoding rounds, not prompts or training batches) run
# through compiled pieces: their shapes repeat, and on small models the time of a round
# is mostly per-operation overhead, which compilation fuses away.
COMPILED_TOKENS = 64


def compiled_piece(module: nn.Module, fn: Callable, tokens: int) -> Callable:
    """``fn`` bound to ``module``, compiled once per module for short blocks. The
    module's weights are inputs of the compiled function, read at every call."""
    if tokens > COMPILED_TOKENS:
        return partial(fn, module)
    pieces = module.__dict__.get("_compiled_pieces")
    if pieces is None:
        pieces = {}
        object.__setattr__(module, "_compiled_pieces", pieces)  # an attribute, not a parameter
    if fn not in pieces:
        pieces[fn] = mx.compile(partial(fn, module), inputs=module)
    return pieces[fn]


def layer_block(layer: nn.Module, residual: mx.array, x: mx.array, cache, positions: Positions,
                mask: Mask) -> mx.array:
    """``residual`` + attention over ``x`` (with our positions and mask), then the layer's
    MLP with its residual: an mlx-lm decoder layer's computation."""
    tokens = x.shape[1]
    positions = mx.array(positions) if isinstance(positions, int) else positions  # traced, not a constant
    queries, keys, values = compiled_piece(layer.self_attn, _project, tokens)(x, positions)
    keys, values = cache.update_and_fetch(keys, values)
    attended = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=layer.self_attn.scale,
                                            mask=mask)
    return compiled_piece(layer, _finish, tokens)(residual, attended)


def decoder_layer(layer: nn.Module, x: mx.array, cache, positions: Positions, mask: Mask) -> mx.array:
    return layer_block(layer, x, layer.input_layernorm(x), cache, positions, mask)


@dataclass
class TargetOutput:
    logits: mx.array  # [batch, tokens, vocab]
    features: mx.array  # [batch, tokens, feature width]: what the draft head reads
    hidden: Optional[mx.array] = None  # [batch, tokens, hidden]: the post-norm last state


def drives(model: nn.Module) -> bool:
    """Whether this module knows how to drive ``model``'s layers (tree masks, per-token
    positions, feature taps, compiled pieces)."""
    return getattr(getattr(model, "args", None), "model_type", None) in SUPPORTED_MODEL_TYPES


def check_target(model: nn.Module) -> None:
    if not drives(model):
        model_type = getattr(getattr(model, "args", None), "model_type", None)
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
