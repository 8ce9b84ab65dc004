"""What mlx-lm lacks for EAGLE, written once: attention with per-token positions and
tree masks, the target's forward pass with feature taps, and KV-cache compaction.

These drive the modules of an mlx-lm model of an architecture in architectures.py
directly (their weights, RoPE, experts and KV caches), since a model's own ``__call__``
only takes one position offset and builds its own causal mask. The architectures differ
in a few names (heads, scale, the feed-forward block), in attention sinks (gpt_oss), in
Gemma 3's normed sublayer outputs and scaled embeddings, and in sliding-window layers
(gpt_oss, Gemma 3), which here keep full caches and see their window through the mask,
so that any branch of a tree can be cut out of the cache again. The hybrid families run
their own forward passes, which verify chains; ``tapped_forward`` records the states
entering their layers on the way, for EAGLE-3 heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from inspect import signature
from typing import Callable, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import cache as mlx_lm_cache
from mlx_lm.models.base import create_causal_mask, scaled_dot_product_attention
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START, generate_step, maybe_quantize_kv_cache
from mlx_lm.models.cache import KVCache, QuantizedKVCache
from mlx_lm.models.gemma3_text import clip_residual

from .architectures import ARCHITECTURES, DRIVEN_MODEL_TYPES
from .errors import UserError

ATTENTION_NAMES = tuple(dict.fromkeys(a.attention for a in ARCHITECTURES.values()))
FEED_FORWARD_NAMES = tuple(dict.fromkeys(a.feed_forward for a in ARCHITECTURES.values()))

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


def attention_sizes(attn: nn.Module) -> Tuple[int, int, float]:
    """An mlx-lm attention module's (query heads, key/value heads, scale), under the names
    its architecture's record gives them (EAGLE heads use llama's)."""
    for heads, kv_heads, scale in ATTENTION_NAMES:
        if hasattr(attn, heads):
            return getattr(attn, heads), getattr(attn, kv_heads), getattr(attn, scale)
    raise TypeError(f"{type(attn).__name__} names its heads in a way target.py does not know")


def feed_forward(layer: nn.Module) -> nn.Module:
    """A decoder layer's MLP or mixture of experts (as its architecture's record names it)."""
    return next(layer[name] for name in FEED_FORWARD_NAMES if name in layer)


def _project(attn: nn.Module, x: mx.array, positions: mx.array) -> Tuple[mx.array, mx.array, mx.array]:
    """An mlx-lm attention module's queries, keys and values for ``x``, rotated."""
    batch, length, _ = x.shape
    heads, kv_heads, _ = attention_sizes(attn)
    queries = attn.q_proj(x).reshape(batch, length, heads, -1)
    keys = attn.k_proj(x).reshape(batch, length, kv_heads, -1)
    values = attn.v_proj(x).reshape(batch, length, kv_heads, -1)
    if "q_norm" in attn:
        queries, keys = attn.q_norm(queries), attn.k_norm(keys)
    queries = rotate(attn.rope, queries.transpose(0, 2, 1, 3), positions)
    keys = rotate(attn.rope, keys.transpose(0, 2, 1, 3), positions)
    return queries, keys, values.transpose(0, 2, 1, 3)


def _finish(layer: nn.Module, residual: mx.array, attended: mx.array) -> mx.array:
    """The rest of a decoder layer after attention: output projection, residual, MLP."""
    batch, _, length, _ = attended.shape
    out = layer.self_attn.o_proj(attended.transpose(0, 2, 1, 3).reshape(batch, length, -1))
    if "pre_feedforward_layernorm" in layer:  # Gemma 3: each sublayer's output is normed before its residual
        h = clip_residual(residual, layer.post_attention_layernorm(out))
        mlp = feed_forward(layer)(layer.pre_feedforward_layernorm(h))
        return clip_residual(h, layer.post_feedforward_layernorm(mlp))
    h = residual + out
    return h + feed_forward(layer)(layer.post_attention_layernorm(h))


# Blocks up to this many tokens (decoding rounds, not prompts or training batches) run
# through compiled pieces: their shapes repeat, and on small models the time of a round
# is mostly per-operation overhead, which compilation fuses away.
COMPILED_TOKENS = 64


def compiled_piece(module: nn.Module, fn: Callable, tokens: int, *constants) -> Callable:
    """``fn`` bound to ``module`` (and ``constants``), compiled once per module for short
    blocks. The module's weights are inputs of the compiled function, read at every call."""
    if tokens > COMPILED_TOKENS:
        return partial(fn, module, *constants)
    pieces = module.__dict__.get("_compiled_pieces")
    if pieces is None:
        pieces = {}
        object.__setattr__(module, "_compiled_pieces", pieces)  # an attribute, not a parameter
    if (fn, constants) not in pieces:
        pieces[fn, constants] = mx.compile(partial(fn, module, *constants), inputs=module)
    return pieces[fn, constants]


def _latent_project(attn: nn.Module, x: mx.array, positions: mx.array) -> Tuple[mx.array, ...]:
    """Multi-head latent attention's (DeepSeek-V3, GLM-4.7-Flash) queries, as their
    position-free and rotated parts, and its keys/values: the normed latent and the
    rotated part shared by every head."""
    batch, length, _ = x.shape
    queries = attn.q_proj(x) if attn.q_lora_rank is None else attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
    queries = queries.reshape(batch, length, attn.num_heads, attn.q_head_dim).transpose(0, 2, 1, 3)
    queries, rotated_queries = mx.split(queries, [attn.qk_nope_head_dim], axis=-1)
    latent, rotated_keys = mx.split(attn.kv_a_proj_with_mqa(x), [attn.kv_lora_rank], axis=-1)
    rotated_keys = rotated_keys.reshape(batch, length, 1, attn.qk_rope_head_dim).transpose(0, 2, 1, 3)
    latent = mx.expand_dims(attn.kv_a_layernorm(latent), axis=1)
    return (queries, rotate(attn.rope, rotated_queries, positions), latent,
            rotate(attn.rope, rotated_keys, positions))


def _latent_attention(attn: nn.Module, x: mx.array, cache, positions: mx.array, mask: Mask) -> mx.array:
    """Multi-head latent attention over ``x``, its cache holding the latents (as keys) and
    the rotated keys (as values), as mlx-lm's own module keeps them: the rotated parts'
    scores, masked, are the additive mask of the position-free attention."""
    tokens = x.shape[1]
    if isinstance(mask, str):  # a contiguous block where the cache ends
        mask = create_causal_mask(tokens, cache.offset)
    queries, rotated_queries, latent, rotated_keys = compiled_piece(attn, _latent_project, tokens)(x, positions)
    latent, rotated_keys = cache.update_and_fetch(latent, rotated_keys)
    scores = (rotated_queries * attn.scale) @ rotated_keys.swapaxes(-1, -2)
    if mask is not None:
        scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
    keys, values = attn.embed_q(latent, transpose=False), attn.unembed_out(latent)
    return scaled_dot_product_attention(queries, keys, values, cache=cache, scale=attn.scale, mask=scores)


def layer_block(layer: nn.Module, residual: mx.array, x: mx.array, cache, positions: Positions,
                mask: Mask) -> mx.array:
    """``residual`` + attention over ``x`` (with our positions and mask), then the layer's
    MLP with its residual: an mlx-lm decoder layer's computation."""
    tokens = x.shape[1]
    positions = mx.array(positions) if isinstance(positions, int) else positions  # traced, not a constant
    attn = layer.self_attn
    if "kv_a_proj_with_mqa" in attn:
        attended = _latent_attention(attn, x, cache, positions, mask)
    else:
        queries, keys, values = compiled_piece(attn, _project, tokens)(x, positions)
        keys, values = cache.update_and_fetch(keys, values)
        if hasattr(cache, "attend"):  # a cache that knows its own attention pattern (TTTCache, PackedCache)
            attended = cache.attend(queries, attention_sizes(attn)[2])
        else:
            attended = scaled_dot_product_attention(queries, keys, values, cache=cache,
                                                    scale=attention_sizes(attn)[2], mask=mask, sinks=attn.get("sinks"))
    return compiled_piece(layer, _finish, tokens)(residual, attended)


def decoder_layer(layer: nn.Module, x: mx.array, cache, positions: Positions, mask: Mask) -> mx.array:
    return layer_block(layer, x, layer.input_layernorm(x), cache, positions, mask)


@dataclass
class TargetOutput:
    logits: Optional[mx.array]  # [batch, tokens, vocab] (None: a packed block that wanted none)
    features: mx.array  # [batch, tokens, feature width]: what the draft head reads
    hidden: Optional[mx.array] = None  # [batch, tokens, hidden]: the post-norm last state


def is_driven(model: nn.Module) -> bool:
    """Whether this module knows how to drive ``model``'s layers (tree masks, per-token
    positions, feature taps, compiled pieces): not where they are pipelined over several
    machines, which only the model's own forward pass passes the state between."""
    return getattr(getattr(model, "args", None), "model_type", None) in DRIVEN_MODEL_TYPES \
        and pipeline_stage(model) is None


def pipeline_stage(model: nn.Module) -> Optional[Tuple[int, int]]:
    """The layers (first, past the last) this rank runs of a model mlx-lm pipelines over
    several machines (``model.model.pipeline``), or None. Each rank keeps only its own
    layers: the last ones on rank 0, the first ones on the last rank."""
    inner = model.get("model") if isinstance(model, nn.Module) else None
    if getattr(inner, "pipeline_size", 1) <= 1:
        return None
    return inner.start_idx, inner.end_idx


def check_target(model: nn.Module, taps: Optional[Sequence[int]] = None) -> None:
    """That a drafter reading the target states at ``taps`` can read them from ``model``:
    where target.py drives its layers, or on any other text model whose final norm it
    knows (the hybrid families among them), whose own forward pass verifies chains and
    records the states (tapped_forward)."""
    if is_driven(model):
        return
    model_type = getattr(getattr(model, "args", None), "model_type", None)
    inner = model.get("model", model.get("backbone"))
    if isinstance(inner, nn.Module) and "layers" in inner and any(name in inner for name in FINAL_NORMS):
        return  # its own forward pass, its states recorded on the way (tapped_forward)
    record = ARCHITECTURES.get(model_type)
    hint = (f"pass its text model (model.{record.text_model}), as mlx_eagle.load does" if record else
            "drafts from the context (--draft lookup) work with it")
    raise UserError(f"EAGLE decoding supports {', '.join(DRIVEN_MODEL_TYPES)} targets, not {model_type!r}; {hint}")


def inner_model(model: nn.Module) -> nn.Module:
    """The module holding an mlx-lm model's embedding and decoder layers (``model.model``;
    ``model.backbone`` for Mamba 2 and Nemotron-H)."""
    return model["model"] if "model" in model else model["backbone"]


def layer_count(model: nn.Module) -> int:
    """The model's decoder layers, all of them where a rank runs only its stage."""
    if pipeline_stage(model) is not None:
        return model.args.num_hidden_layers
    return len(inner_model(model).layers)


def embedding_layer(model: nn.Module) -> nn.Module:
    """The target's token embedding, unscaled (what an EAGLE head embeds its tokens with)."""
    inner = inner_model(model)
    return inner["embed_tokens"] if "embed_tokens" in inner else inner["embeddings"]


def compute_dtype(model: nn.Module) -> mx.Dtype:
    """The floating-point type the target computes in (its embedding's, quantized or not)."""
    layer = embedding_layer(model)
    return layer["scales"].dtype if "scales" in layer else layer.weight.dtype


# What mlx-lm's models call the norm before their LM head (Qwen3-Next, Qwen3.5, Granite 4 and
# Kimi Linear; Nemotron-H and Mamba 2; LFM2; Falcon-H1 and Jamba).
FINAL_NORMS = ("norm", "norm_f", "embedding_norm", "final_layernorm")


class _Tap:
    """A module that records the state entering it (or, ``output``, leaving it), then runs
    as itself."""

    def __init__(self, module: nn.Module, states: dict, key, output: bool = False):
        self._module, self._states, self._key, self._output = module, states, key, output

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        out = self._module(x, *args, **kwargs)
        self._states[self._key] = out if self._output else x
        return out

    def __getattr__(self, name: str):  # what the model's loop asks of its layers (kinds, flags)
        return getattr(self._module, name)


def tapped_forward(model: nn.Module, tokens: mx.array, cache: List, taps: Sequence[int]) -> TargetOutput:
    """The model's own forward pass over ``tokens`` [batch, n] (appended to ``cache``, from
    where it ends), with the states entering ``taps`` and the post-norm last state recorded
    on the way: what a drafter reads, from a model whose layers target.py does not drive
    (the hybrid families, each with its own recurrent masks and caches). ``taps`` empty:
    the features are the post-norm last state. Only logits that are read get computed.
    On a pipelined model each rank records the taps among its own layers, and one all-sum
    gives every rank all of them (after the model's own all-gather: every rank's
    collectives in the same order)."""
    inner = inner_model(model)
    layers, norm = inner.layers, next(name for name in FINAL_NORMS if name in inner)
    stage = pipeline_stage(model)
    states: dict = {}
    originals = {index: layers[index] for index in taps if stage is None or stage[0] <= index < stage[1]}
    final = inner[norm]
    try:
        for index, layer in originals.items():
            layers[index] = _Tap(layer, states, index)
        inner[norm] = _Tap(final, states, "hidden", output=True)
        logits = model(tokens, cache=cache)
    finally:
        for index, layer in originals.items():
            layers[index] = layer
        inner[norm] = final
    hidden = states["hidden"]
    if not taps:
        return TargetOutput(logits=logits, features=hidden, hidden=hidden)
    features = mx.concatenate([states[i] if i in states else mx.zeros_like(hidden) for i in taps], axis=-1)
    if stage is not None:
        features = mx.distributed.all_sum(mx.depends(features, hidden))
    return TargetOutput(logits=logits, features=features, hidden=hidden)


def make_cache(model: nn.Module) -> List:
    """The target's KV caches. For a model this module drives, a full cache per layer,
    sliding-window layers included (their window is applied by the mask): a rotating
    cache could not give back the entries of a rejected branch."""
    if is_driven(model):
        return [KVCache() for _ in model.model.layers]
    return mlx_lm_cache.make_prompt_cache(model)


def layer_windows(model: nn.Module) -> List[Optional[int]]:
    """Per layer, the attention window (None: the whole context): gpt-oss names its layers'
    kinds, Gemma 3's attention modules say whether they slide."""
    inner = model.model
    if getattr(inner, "layer_types", None) is not None:
        return [inner.window_size if kind == "sliding_attention" else None for kind in inner.layer_types]
    return [inner.window_size if getattr(layer.self_attn, "is_sliding", False) else None for layer in inner.layers]


def embed(model: nn.Module, tokens: mx.array) -> mx.array:
    """The target's input embeddings of ``tokens``, scaled where its architecture scales them."""
    h = embedding_layer(model)(tokens)
    if ARCHITECTURES[model.args.model_type].embedding_scale:
        h = h * mx.array(model.args.hidden_size ** 0.5, mx.bfloat16).astype(h.dtype)
    return h


def window_mask(mask: Mask, positions: Positions, keys: Union[int, mx.array], new: int, window: int) -> Mask:
    """``mask`` narrowed for a sliding-window layer: a query at position p sees keys at
    positions > p - window. ``keys``: how many entries are cached (at positions
    0..keys-1, the new ones after them), or the position of every entry ``mask`` covers."""
    if isinstance(positions, int):
        if positions + new <= window:  # no query reaches past its window yet
            return mask
        queries = mx.arange(positions, positions + new)
    else:
        queries = positions
    if isinstance(keys, int):
        keys = mx.concatenate([mx.arange(keys), queries])
    inside = (queries[:, None] - keys[None]) < window
    if mask is None:
        return inside
    if isinstance(mask, str):  # "causal" over a contiguous block
        return inside & (keys[None] <= queries[:, None])
    return inside & mask


def _output_layer(model: nn.Module) -> nn.Module:
    """The LM head, or the embedding it is tied to."""
    return model.lm_head if "lm_head" in model else model.model.embed_tokens


def lm_head(model: nn.Module, hidden: mx.array) -> mx.array:
    if "lm_head" in model:
        return model.lm_head(hidden)
    return model.model.embed_tokens.as_linear(hidden)


def lm_head_rows(model: nn.Module, hidden: mx.array, rows: mx.array) -> mx.array:
    """The LM head's logits for vocabulary ``rows`` only: a draft vocabulary's share of
    the head, without paying for the whole vocabulary."""
    layer = _output_layer(model)
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
    key_positions: Optional[mx.array] = None,
) -> TargetOutput:
    """One forward pass over ``tokens`` [batch, n], appending them to ``cache``.

    ``taps`` None returns the post-norm last hidden state (EAGLE-1/2 features);
    otherwise the states entering those layers, concatenated (EAGLE-3).
    ``key_positions``: the position of each entry ``mask`` covers, where they are not the
    cached ones in order and then the new ones (for sliding windows).
    """
    inner = model.model
    h = embed(model, tokens)
    keys = cache[0].offset if key_positions is None else key_positions
    masks = {None: mask}  # per window size
    entering = {}
    for index, (layer, layer_cache, window) in enumerate(zip(inner.layers, cache, layer_windows(model))):
        if taps is not None and index in taps:
            entering[index] = h
        if window not in masks:
            masks[window] = window_mask(mask, positions, keys, tokens.shape[1], window)
        h = decoder_layer(layer, h, layer_cache, positions, masks[window])
    h = inner.norm(h)
    features = h if taps is None else mx.concatenate([entering[i] for i in taps], axis=-1)
    return TargetOutput(logits=lm_head(model, h), features=features, hidden=h)


@dataclass
class Block:
    """One conversation's part of a packed forward pass: its ``tokens`` [n], appended to its
    own ``cache`` at ``positions`` (the first token's, a chain's running on from there, or
    one per token), attending under ``mask``; ``taps``: the layers whose entering states it
    reads (None: the post-norm last hidden state, as target_forward gives them).
    ``logits``: whether its rows' logits are wanted (a prompt's chunk read inside the pass
    wants none: the LM head then skips its rows)."""

    tokens: mx.array
    cache: List
    positions: Positions
    mask: Mask
    taps: Optional[Sequence[int]] = None
    logits: bool = True

    def position_of_each(self) -> mx.array:
        if isinstance(self.positions, int):
            return mx.arange(self.positions, self.positions + self.tokens.size)
        return self.positions


def packs(model: nn.Module) -> bool:
    """Whether packed_forward runs ``model``: this module drives it, and every layer's
    attention is the projections-then-attention kind (not latent attention; no recurrent
    layers, which is_driven already leaves out)."""
    return is_driven(model) and not ARCHITECTURES[model.args.model_type].latent_attention


class PackedCache:
    """One layer's caches of several conversations whose tokens are packed into one
    sequence, ``cuts`` apart (where each one's tokens begin, then the end), standing as the
    layer's cache in layer_block: each cache gets its own tokens' keys and values appended,
    and each conversation's queries attend over its own cache under its own mask (and the
    layer's attention ``sinks``). Everything else in the layer reads the packed tokens as
    one sequence."""

    def __init__(self, caches: Sequence, cuts: Sequence[int], masks: Sequence[Mask], sinks: Optional[mx.array] = None):
        self.caches, self.cuts, self.masks, self.sinks = caches, cuts, masks, sinks
        self.fetched: List[Tuple[mx.array, mx.array]] = []

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Tuple[mx.array, mx.array]:
        self.fetched = [cache.update_and_fetch(keys[:, :, begin:end], values[:, :, begin:end])
                        for cache, begin, end in zip(self.caches, self.cuts, self.cuts[1:])]
        return keys, values

    def attend(self, queries: mx.array, scale: float) -> mx.array:
        return mx.concatenate([
            scaled_dot_product_attention(queries[:, :, begin:end], keys, values, cache=cache, scale=scale, mask=mask,
                                         sinks=self.sinks)
            for cache, (keys, values), mask, begin, end in zip(self.caches, self.fetched, self.masks, self.cuts,
                                                               self.cuts[1:])], axis=2)


def cuts_of(sizes: Sequence[int]) -> List[int]:
    """Where each of several packed pieces of ``sizes`` tokens begins, then the end."""
    cuts = [0]
    for size in sizes:
        cuts.append(cuts[-1] + size)
    return cuts


def packed_forward(model: nn.Module, blocks: Sequence[Block]) -> List[TargetOutput]:
    """One forward pass over several conversations' blocks: their tokens packed into one
    sequence through everything that reads a token alone (embedding, norms, projections,
    rotary positions, MLPs, the LM head), and each block's attention over its own cache,
    with its own positions and mask (PackedCache). Each cache gets its block appended, as
    target_forward appends one. The matrix products see more rows than a block's alone, so
    their results may differ in the last bits: the decoder rechecks greedy near-ties as it
    does a block's."""
    inner = model.model
    cuts = cuts_of([block.tokens.size for block in blocks])
    h = embed(model, mx.concatenate([block.tokens.astype(mx.int32) for block in blocks])[None])
    positions = mx.concatenate([block.position_of_each() for block in blocks])
    offsets = [block.cache[0].offset for block in blocks]
    masks: List[dict] = [{None: block.mask} for block in blocks]  # per block, per window size
    taps = sorted({tap for block in blocks for tap in (block.taps or ())})
    entering = {}
    for index, (layer, window) in enumerate(zip(inner.layers, layer_windows(model))):
        if index in taps:
            entering[index] = h
        for block, begin, end, offset, block_masks in zip(blocks, cuts, cuts[1:], offsets, masks):
            if window not in block_masks:
                block_masks[window] = window_mask(block.mask, block.positions, offset, end - begin, window)
        packed = PackedCache([block.cache[index] for block in blocks], cuts,
                             [block_masks[window] for block_masks in masks], layer.self_attn.get("sinks"))
        h = decoder_layer(layer, h, packed, positions, None)
    h = inner.norm(h)
    wanted = [h[:, begin:end] for block, begin, end in zip(blocks, cuts, cuts[1:]) if block.logits]
    if len(wanted) == len(blocks):  # (every block's rows: no copy)
        logits = lm_head(model, h)
    else:
        logits = lm_head(model, mx.concatenate(wanted, axis=1)) if wanted else None
    outputs, row = [], 0  # (where the next wanted block's rows begin in ``logits``)
    for block, begin, end in zip(blocks, cuts, cuts[1:]):
        hidden = h[0, begin:end]
        features = hidden if block.taps is None else \
            mx.concatenate([entering[i][0, begin:end] for i in block.taps], axis=-1)
        rows = None
        if block.logits:
            rows, row = logits[0, row:row + end - begin], row + end - begin
        outputs.append(TargetOutput(logits=rows, features=features, hidden=hidden))
    return outputs


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
        if not contiguous:  # (a quantized cache holds each of keys and values as packed values, scales, biases)
            for stored in (layer_cache.keys, layer_cache.values):
                for part in stored if isinstance(stored, (tuple, list)) else (stored,):
                    part[..., start:start + count, :] = part[..., source, :]
        layer_cache.trim(max(0, layer_cache.offset - (start + count)))  # as each cache kind rewinds


KV_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize packs
KV_GROUP_SIZES = (32, 64, 128)


# How many prompt tokens plain mlx-lm reads in one forward pass (generate_step's default).
MLX_LM_PREFILL_STEP: int = signature(generate_step).parameters["prefill_step_size"].default


@dataclass(frozen=True)
class KVQuantization:
    """Quantized KV caches, as mlx-lm's ``kv_bits``, ``kv_group_size`` and
    ``quantized_kv_start`` set them: once the target's cache holds ``start`` entries, each
    layer's cache becomes mlx-lm's QuantizedKVCache (``bits`` per value, a scale and bias per
    ``group_size`` values), and every later forward pass attends to quantized keys and values,
    its own included. A verified tree attends the same way, and cutting a rejected branch out
    moves the packed entries (keep_cache_entries)."""

    bits: int
    group_size: int = 64
    start: int = DEFAULT_QUANTIZED_KV_START

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or self.bits not in KV_BITS:
            raise UserError(f"kv_bits must be one of {', '.join(map(str, KV_BITS))}, not {self.bits!r}")
        if isinstance(self.group_size, bool) or self.group_size not in KV_GROUP_SIZES:
            raise UserError(f"kv_group_size must be one of {', '.join(map(str, KV_GROUP_SIZES))}, "
                            f"not {self.group_size!r}")
        if isinstance(self.start, bool) or not isinstance(self.start, int) or self.start < 0:
            raise UserError(f"quantized_kv_start must be a whole number, 0 or more, not {self.start!r}")

    def check(self, cache: List) -> None:
        """One line where ``cache`` cannot be quantized: mlx-lm quantizes only full KV caches
        (not a sliding window's rotating one, nor a recurrent state's, which speculation
        also rewinds)."""
        for layer_cache in cache:
            kind = type(layer_cache)
            if kind not in (KVCache, QuantizedKVCache):
                raise UserError(f"quantized KV caches (kv_bits) do not work with this model's {kind.__name__} "
                                "layers (sliding windows or recurrent state); leave kv_bits out")

    def check_model(self, model: nn.Module) -> None:
        """``check`` on ``model``'s caches, and its keys' and values' head sizes against the
        group size (mlx.quantize splits the last axis into groups): one line, before
        anything is timed or read."""
        self.check(make_cache(model))
        args = model.args
        heads = getattr(args, "num_attention_heads", None)
        sizes = {getattr(args, name, None) for name in ("head_dim", "k_head_dim", "v_head_dim")} - {None}
        if not sizes and heads:
            sizes = {args.hidden_size // heads}
        for size in sorted(sizes):
            if size % self.group_size:
                fits = [g for g in KV_GROUP_SIZES if size % g == 0]
                fix = f"give --kv-group-size {fits[-1]}" if fits else "leave kv_bits out"
                raise UserError(f"kv_group_size {self.group_size} does not divide this model's attention head size "
                                f"({size}); {fix}")

    def turns_at(self, prompt_length: int, step: int = MLX_LM_PREFILL_STEP) -> int:
        """How many entries plain mlx-lm's cache holds when it turns quantized while reading
        a prompt of ``prompt_length`` tokens and decoding after it: its prompt is read in
        chunks of ``step`` up to the last token, which the first step reads, and the cache
        is quantized after the first forward pass that leaves ``start`` entries."""
        last = prompt_length - 1
        ends = [min(end, last) for end in range(step, last + step, step)]
        return next((end for end in ends if end >= self.start), max(self.start, prompt_length))

    def holds_as_plain(self, cache: List, entries: int, prompt_length: int) -> bool:
        """Whether ``cache``'s first ``entries`` are what plain decoding of a prompt of
        ``prompt_length`` tokens would hold there: unquantized before its cache turns
        (where it turns, mlx-lm quantizes what was read in float), quantized after. A
        quantized cache cut back before that point is not: the rest of the prompt would
        attend to packed keys where plain decoding attends to float ones."""
        return not isinstance(cache[0], QuantizedKVCache) or entries >= self.turns_at(prompt_length)

    def quantize_when_due(self, cache: List) -> None:
        """Quantize the layers' caches once they hold ``start`` entries, as mlx-lm does
        after each forward pass."""
        maybe_quantize_kv_cache(cache, self.start, self.group_size, self.bits)

    def room(self, cache: List, position: int, room: int) -> int:
        """How many tokens a round from ``position`` may produce: while the cache is not yet
        quantized, none of its drafts past ``start`` (their rows would attend to what plain
        decoding attends to quantized), so that the round ends where the cache turns."""
        if isinstance(cache[0], QuantizedKVCache) or position >= self.start:
            return room
        return max(1, min(room, self.start - position))


def kv_quantization(kv_bits: Optional[int] = None, kv_group_size: int = 64,
                    quantized_kv_start: Optional[int] = None) -> Optional[KVQuantization]:
    """The quantization mlx-lm's settings ask for (None: none, ``kv_bits`` None;
    ``quantized_kv_start`` None: mlx-lm's default)."""
    if kv_bits is None:
        if quantized_kv_start is not None:
            raise UserError(f"quantized_kv_start ({quantized_kv_start}) quantizes nothing without kv_bits; give "
                            "kv_bits 4 or 8 too, or leave it out")
        return None
    return KVQuantization(kv_bits, kv_group_size,
                          DEFAULT_QUANTIZED_KV_START if quantized_kv_start is None else quantized_kv_start)


def default_taps(num_layers: int) -> Tuple[int, int, int]:
    """EAGLE-3's low, middle and high taps: the states entering these layers."""
    return (2, num_layers // 2, num_layers - 3)
