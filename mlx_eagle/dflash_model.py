"""DFlash block drafters' model (arXiv 2602.06036; the z-lab checkpoint layout): a few
decoder layers with no embedding or LM head of their own that read the target's states at
some of its layers, fused into one context vector per position, and predict a whole block
[root, mask, ..., mask] in one forward pass. Each layer's queries come from the block only;
its keys and values are those of the context (projected from the fused states, cached
across rounds) followed by the block's own (never cached), and the block attends to all of
them, itself bidirectionally. Reading, checking, making and saving checkpoints live here
too; drafting with it is drafters/dflash.py's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope
from mlx_lm.utils import dequantize_model

from .configs import read_config as read_json_config
from .errors import UserError
from .heads import read_safetensors
from .target import compute_dtype, cuts_of, embed, layer_count, rotate

@dataclass
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    block_size: int
    target_layer_ids: Tuple[int, ...]  # the target layers whose outputs are fused
    mask_token_id: int
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 32768
    layer_types: Tuple[str, ...] = ()
    sliding_window: Optional[int] = None
    is_causal: Optional[bool] = None  # within the block; None: only sliding layers are (as z-lab's code)
    attention_bias: bool = False  # q/k/v/o projections with biases (a Qwen3 config's attention_bias)
    rope_interleave: bool = False  # rotary pairs interleaved (GPT-J style, as LFM2.5's DSpark drafters), not halves
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def taps(self) -> Tuple[int, ...]:
        """Layer ``i``'s output is the state entering layer ``i + 1``: target.py's taps."""
        return tuple(i + 1 for i in self.target_layer_ids)


def _config_number(raw: dict, name: str, kind: type, low: float, high: float, source: Path, default: Any = None):
    value = raw.get(name, default)
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (kind is int and value != int(value)) or not low <= value <= high:
        raise UserError(f"{source}: {name} must be {'an integer' if kind is int else 'a number'} from {low} to {high}, "
                        f"not {value!r}")
    return kind(value)


def dflash_config(raw: dict, source: Path) -> DFlashConfig:
    """The checkpoint's config.json, checked: one line for the first thing that is wrong."""
    dflash = raw.get("dflash_config")
    if not isinstance(dflash, dict):
        raise UserError(f"{source}: no dflash_config (mask_token_id, target_layer_ids); not a DFlash checkpoint")
    if any(name in dflash or name in raw for name in ("conv_kernel_size", "selector_rank")) or \
            "DFlash2DraftModel" in (raw.get("architectures") or []):
        raise UserError(f"{source}: a DFlash2 checkpoint (convolution kernels and a candidate selector) is not "
                        "supported yet; use a DFlash (z-lab) checkpoint")
    return DFlashConfig(**backbone_fields(raw, dflash, source, "dflash_config.", lowest_layer=0,
                                          default_block=raw.get("block_size", 16)))


def backbone_fields(raw: dict, block: dict, source: Path, where: str, lowest_layer: int,
                    default_block: Any) -> Dict[str, Any]:
    """The block drafter's backbone settings (DFlash's and DSpark's), checked: its decoder
    layers from ``raw``, and the block's (target_layer_ids, mask_token_id, block_size) from
    ``block`` (``where``: what its names are called in messages); a target layer id of -1
    (DSpark's) is the embedding output."""
    ids = block.get("target_layer_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool)
                                                       and lowest_layer <= i for i in ids):
        raise UserError(f"{source}: {where}target_layer_ids must be a list of layer numbers, not {ids!r}")
    layers = _config_number(raw, "num_hidden_layers", int, 1, 64, source)
    types = tuple(raw.get("layer_types") or ("full_attention",) * layers)
    if len(types) != layers or set(types) - {"full_attention", "sliding_attention"}:
        raise UserError(f"{source}: layer_types must name full_attention or sliding_attention for each of the "
                        f"{layers} layers")
    window = raw.get("sliding_window") if "sliding_attention" in types else None
    if "sliding_attention" in types:
        window = _config_number(raw, "sliding_window", int, 1, 1 << 24, source)
    hidden = _config_number(raw, "hidden_size", int, 1, 1 << 16, source)
    heads = _config_number(raw, "num_attention_heads", int, 1, 1024, source)
    causal = raw.get("is_causal")
    return dict(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=_config_number(raw, "num_key_value_heads", int, 1, heads, source, heads),
        head_dim=_config_number(raw, "head_dim", int, 1, 1024, source, hidden // heads),
        intermediate_size=_config_number(raw, "intermediate_size", int, 1, 1 << 18, source),
        vocab_size=_config_number(raw, "vocab_size", int, 1, 1 << 22, source),
        rms_norm_eps=_config_number(raw, "rms_norm_eps", float, 0, 1, source, 1e-6),
        block_size=_config_number(block, "block_size", int, 2, 64, source, default_block),
        target_layer_ids=tuple(ids), mask_token_id=_config_number(block, "mask_token_id", int, 0, 1 << 22, source),
        rope_theta=_config_number(raw, "rope_theta", float, 1, 1e12, source, 10000.0),
        rope_scaling=raw.get("rope_scaling") if isinstance(raw.get("rope_scaling"), dict) else None,
        max_position_embeddings=_config_number(raw, "max_position_embeddings", int, 1, 1 << 24, source, 32768),
        layer_types=types, sliding_window=window, is_causal=causal if isinstance(causal, bool) else None,
        attention_bias=raw.get("attention_bias") is True, rope_interleave=raw.get("rope_interleave") is True,
    )


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig, sliding: bool):
        super().__init__()
        self.n_heads, self.n_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.scale = config.head_dim ** -0.5
        self.window = config.sliding_window if sliding else None
        self.causal = sliding if config.is_causal is None else config.is_causal
        width, bias = config.head_dim, config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.n_heads * width, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.n_kv_heads * width, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.n_kv_heads * width, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * width, config.hidden_size, bias=bias)
        self.q_norm = nn.RMSNorm(width, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(width, eps=config.rms_norm_eps)
        self.rope = initialize_rope(width, config.rope_theta, config.rope_interleave, config.rope_scaling,
                                    config.max_position_embeddings)

    def keys_values(self, x: mx.array, positions: mx.array) -> Tuple[mx.array, mx.array]:
        """Rotated keys and values of ``x`` [1, n, hidden] at ``positions`` (a scalar: the
        first of n in a row; or one per token)."""
        batch, length, _ = x.shape
        keys = self.k_norm(self.k_proj(x).reshape(batch, length, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        values = self.v_proj(x).reshape(batch, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return rotate(self.rope, keys, positions), values

    def __call__(self, x: mx.array, contexts: Sequence[Tuple[mx.array, mx.array]], positions: mx.array,
                 masks: Sequence[Optional[mx.array]], cuts: Sequence[int]) -> mx.array:
        """Blocks packed in ``x`` [1, n, hidden], one per conversation between ``cuts``: each
        attends to its conversation's ``contexts`` keys and values and to itself, under its
        mask; everything else reads the packed tokens as one sequence."""
        batch, length, _ = x.shape
        queries = self.q_norm(self.q_proj(x).reshape(batch, length, self.n_heads, -1)).transpose(0, 2, 1, 3)
        queries = rotate(self.rope, queries, positions)
        keys, values = self.keys_values(x, positions)
        out = mx.concatenate([
            mx.fast.scaled_dot_product_attention(
                queries[:, :, begin:end], mx.concatenate([context[0], keys[:, :, begin:end]], axis=2),
                mx.concatenate([context[1], values[:, :, begin:end]], axis=2), scale=self.scale, mask=mask)
            for context, mask, begin, end in zip(contexts, masks, cuts, cuts[1:])], axis=2)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))

    def block_mask(self, cached: int, start: int, length: int) -> Optional[mx.array]:
        """Where a block at positions start.. after ``cached`` context entries may look:
        everywhere, unless the layer slides or is causal within the block."""
        if not self.causal and self.window is None:
            return None
        query = start + mx.arange(length)[:, None]
        key = mx.concatenate([mx.arange(cached), start + mx.arange(length)])[None]
        mask = key <= query if self.causal else mx.ones((length, cached + length), dtype=mx.bool_)
        return mask & (query - key < self.window) if self.window is not None else mask


class DFlashMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, config: DFlashConfig, sliding: bool):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, sliding)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = DFlashMLP(config.hidden_size, config.intermediate_size)

    def __call__(self, x: mx.array, contexts: Sequence[Tuple[mx.array, mx.array]], positions: mx.array,
                 masks: Sequence[Optional[mx.array]], cuts: Sequence[int]) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), contexts, positions, masks, cuts)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashModel(nn.Module):
    """The drafter's weights, under the z-lab checkpoint's names."""

    def __init__(self, config: DFlashConfig, target_hidden: int):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(len(config.target_layer_ids) * target_hidden, config.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = [DFlashLayer(config, kind == "sliding_attention") for kind in config.layer_types]
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def taps(self, num_target_layers: int) -> Tuple[int, ...]:
        return self.config.taps

    def context(self, states: mx.array) -> mx.array:
        """The fused context vectors of the target's ``states`` [..., taps x hidden]."""
        return self.hidden_norm(self.fc(states))

    def read_context(self, states: mx.array, cache: List[KVCache], start: int) -> None:
        """Append the context keys and values of the target ``states`` [n, taps x hidden]
        (at positions start..start + n - 1) to each layer's ``cache``."""
        self.read_contexts([(states, cache, start)])

    def read_contexts(self, rows: Sequence[Tuple[mx.array, List[KVCache], int]]) -> None:
        """``read_context`` for several conversations (states, cache, start) in one pass."""
        cuts = cuts_of([states.shape[0] for states, _, _ in rows])
        context = self.context(mx.concatenate([states for states, _, _ in rows])[None])
        positions = mx.concatenate([start + mx.arange(states.shape[0]) for states, _, start in rows])
        for index, layer in enumerate(self.layers):
            keys, values = layer.self_attn.keys_values(context, positions)
            for (_, cache, _), begin, end in zip(rows, cuts, cuts[1:]):
                cache[index].update_and_fetch(keys[:, :, begin:end], values[:, :, begin:end])

    def blocks_states(self, target: nn.Module, rows: Sequence[Tuple[int, List[KVCache], int]]) -> mx.array:
        """The final (normed) states [rows, block, hidden] of several conversations' blocks
        (root token, cache, start: the block [root, mask, ..., mask] at positions start..,
        after that cache's context), in one pass."""
        block = self.config.block_size
        tokens = mx.array([[root] + [self.config.mask_token_id] * (block - 1) for root, _, _ in rows]).reshape(1, -1)
        # (its norms' dtype is its compute dtype: a quantized drafter's projections hold packed integers)
        h = embed(target, tokens).astype(self.norm.weight.dtype)
        positions = mx.concatenate([start + mx.arange(block) for _, _, start in rows])
        cuts = cuts_of([block] * len(rows))
        for index, layer in enumerate(self.layers):
            attention = layer.self_attn
            contexts, masks = [], []
            for _, cache, start in rows:
                cached = cache[index].offset
                contexts.append((cache[index].keys[..., :cached, :], cache[index].values[..., :cached, :]) if cached
                                else (mx.zeros((1, attention.n_kv_heads, 0, attention.q_norm.weight.shape[0]),
                                               h.dtype),) * 2)
                masks.append(attention.block_mask(cached, start, block))
            h = layer(h, contexts, positions, masks, cuts)
        return self.norm(h).reshape(len(rows), block, -1)


def recognizes(path: Path, config: Optional[dict]) -> bool:
    """A DFlash checkpoint: its config has a dflash_config, or names a DFlash architecture."""
    return config is not None and ("dflash_config" in config or any(
        isinstance(a, str) and "dflash" in a.lower() for a in config.get("architectures") or []))


def load(directory: Path, model: nn.Module) -> DFlashModel:
    """The checkpoint in ``directory`` for the target ``model``, checked against it."""
    return load_checkpoint(directory, model, build, "a DFlash checkpoint")


def load_checkpoint(directory: Path, model: nn.Module, build: Callable, what: str) -> DFlashModel:
    """A block drafter's checkpoint in ``directory`` (``what``: what its messages call it),
    made by ``build(config, weights, model, source)``; it remembers where it came from."""
    directory = Path(directory)
    drafter = build(read_json_config(directory, what), read_safetensors(directory), model, directory / "config.json")
    drafter.directory = directory
    return drafter


def build(raw: dict, weights: Dict[str, mx.array], model: nn.Module, source) -> DFlashModel:
    """The drafter holding a checkpoint's ``weights`` (its config.json: ``raw``), checked
    against the target ``model``; a quantized one (``quantization`` in its config, as the
    converter writes it) is widened on a CPU, as heads are."""
    config = dflash_config(raw, source)
    check_fits(config, model, Path(source).parent, "DFlash")
    return filled(DFlashModel(config, model.args.hidden_size), raw, weights, model, source)


def filled(drafter: DFlashModel, raw: dict, weights: Dict[str, mx.array], model: nn.Module, source) -> DFlashModel:
    """``drafter`` (a block drafter shaped by its config) holding ``weights``, every name
    and shape checked; in the target's compute dtype."""
    weights = {name[len("model."):] if name.startswith("model.") else name: value for name, value in weights.items()}
    quantization = raw.get("quantization")
    if quantization is not None:
        if not isinstance(quantization, dict) or quantization.get("bits") not in (4, 8) or \
                quantization.get("group_size") not in (32, 64, 128):
            raise UserError(f"{source}: quantization must give bits (4 or 8) and group_size (32, 64 or 128), "
                            f"not {quantization!r}")
        nn.quantize(drafter, group_size=quantization["group_size"], bits=quantization["bits"],
                    class_predicate=lambda path, module: f"{path}.scales" in weights)
        drafter.config.extra["quantization"] = quantization
    wanted = {name: value.shape for name, value in tree_flatten(drafter.parameters())}
    missing, extra = sorted(set(wanted) - set(weights)), sorted(set(weights) - set(wanted))
    shapes = sorted(name for name in set(wanted) & set(weights) if tuple(weights[name].shape) != tuple(wanted[name]))
    if missing or extra or shapes:
        problem = ", ".join(f"{len(names)} {what} (e.g. {names[0]})" for names, what in
                            ((missing, "missing"), (extra, "unexpected"), (shapes, "of another shape")) if names)
        raise UserError(f"{Path(source).parent}: the weights do not match its config.json: {problem}")
    drafter.load_weights(list(weights.items()), strict=True)
    if mx.default_device() == mx.cpu:  # MLX's quantized matmuls are slower than float32 on a CPU
        drafter = dequantize_model(drafter)
    drafter.set_dtype(compute_dtype(model), predicate=lambda dtype: mx.issubdtype(dtype, mx.floating))
    mx.eval(drafter.parameters())
    return drafter


def check_fits(config: DFlashConfig, model: nn.Module, source, kind: str) -> None:
    """One line naming what does not match between a ``kind`` block drafter's checkpoint and its target."""
    layers, vocab = layer_count(model), model.args.vocab_size
    problems = []
    if config.hidden_size != model.args.hidden_size:  # it embeds and reads out with the target's own layers
        problems.append(f"hidden size {config.hidden_size} vs the target's {model.args.hidden_size}")
    if config.vocab_size != vocab:
        problems.append(f"vocabulary {config.vocab_size} vs the target's {vocab}")
    if config.mask_token_id >= vocab:
        problems.append(f"mask token {config.mask_token_id} outside the target's vocabulary of {vocab}")
    bad = [i for i in config.target_layer_ids if not i + 1 < layers]
    if bad:
        problems.append(f"target_layer_ids {bad} not below the target's last layer ({layers} layers)")
    if problems:
        raise UserError(f"{kind} drafter {source} does not fit this target: {'; '.join(problems)}")


def published_layer_ids(num_layers: int, count: int = 5) -> List[int]:
    """The target layers a new drafter reads, as the published drafters choose them:
    ``count`` spread from layer 1 to layer N - 3 (Qwen3-8B's 36 layers: 1, 9, 17, 25, 33)."""
    count = max(1, min(count, num_layers - 3))
    return sorted({round(1 + i * (num_layers - 4) / max(count - 1, 1)) for i in range(count)})


def new_dflash(target: nn.Module, layers: int = 5, block_size: int = 16, mask_token_id: int = 0,
               seed: int = 0) -> DFlashModel:
    """A randomly initialised drafter shaped for ``target`` (for training, and for tests)."""
    config = DFlashConfig(**new_backbone_fields(target, layers, block_size, mask_token_id))
    check_fits(config, target, "a new drafter", "DFlash")
    mx.random.seed(seed)
    model = DFlashModel(config, target.args.hidden_size)
    mx.eval(model.parameters())
    return model


def new_backbone_fields(target: nn.Module, layers: int, block_size: int, mask_token_id: int) -> Dict[str, Any]:
    """A new block drafter's backbone settings for ``target``: its attention and MLP
    shapes, reading the published layers."""
    args = target.args
    heads = args.num_attention_heads
    return dict(
        hidden_size=args.hidden_size, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=getattr(args, "num_key_value_heads", None) or heads,
        head_dim=getattr(args, "head_dim", None) or args.hidden_size // heads,
        intermediate_size=args.intermediate_size, vocab_size=args.vocab_size,
        rms_norm_eps=getattr(args, "rms_norm_eps", 1e-6), block_size=block_size,
        target_layer_ids=tuple(published_layer_ids(layer_count(target))), mask_token_id=mask_token_id,
        rope_theta=getattr(args, "rope_theta", 10000.0), layer_types=("full_attention",) * layers)


def save_dflash(model: DFlashModel, path: Path, dtype: Optional[mx.Dtype] = None) -> None:
    """Write config.json and model.safetensors in the z-lab layout (``dtype``: the weights')."""
    config = model.config
    raw = dict(backbone_json(config), architectures=["DFlashDraftModel"], block_size=config.block_size,
               dflash_config={"mask_token_id": config.mask_token_id,
                              "target_layer_ids": list(config.target_layer_ids)})
    write_drafter(model, raw, path, dtype)


def backbone_json(config: DFlashConfig) -> Dict[str, Any]:
    """A block drafter's backbone settings as its config.json (a Qwen3 config) writes them."""
    raw = {"model_type": "qwen3", "hidden_size": config.hidden_size,
           "num_hidden_layers": config.num_hidden_layers, "num_attention_heads": config.num_attention_heads,
           "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim,
           "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size,
           "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
           "max_position_embeddings": config.max_position_embeddings, "attention_bias": config.attention_bias,
           "rope_interleave": config.rope_interleave,
           "layer_types": list(config.layer_types), "tie_word_embeddings": False}
    if config.sliding_window is not None:
        raw["sliding_window"] = config.sliding_window
    if config.rope_scaling is not None:
        raw["rope_scaling"] = config.rope_scaling
    if "quantization" in config.extra:
        raw["quantization"] = config.extra["quantization"]
    return raw


def write_drafter(model: nn.Module, raw: dict, path: Path, dtype: Optional[mx.Dtype]) -> None:
    """``raw`` as config.json and ``model``'s weights as model.safetensors in ``path``
    (``dtype``: the weights', scales and biases too; packed integers stay as they are)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    weights = dict(tree_flatten(model.parameters()))
    if dtype is not None:
        weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    mx.save_safetensors(str(path / "model.safetensors"), weights)
