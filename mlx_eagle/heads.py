"""EAGLE draft heads in MLX, in the official checkpoints' key layouts.

EAGLE-1/2: ``fc`` over [embedding, feature], one decoder layer (``layers.0``) without
an input norm, then the target's LM head. EAGLE-3: ``fc`` over three tapped target
states, a ``midlayer`` whose attention reads [input_layernorm(embedding),
hidden_norm(hidden)] (2H wide), its own ``norm`` and reduced-vocabulary ``lm_head``,
mapped back to target ids by ``d2t``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Protocol, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.models.rope_utils import initialize_rope
from mlx_lm.utils import dequantize_model

from .architectures import target_identity
from .configs import read_config
from .errors import UserError
from .files import read_json
from .target import (
    Mask,
    Positions,
    compiled_piece,
    compute_dtype,
    default_taps,
    embedding_layer,
    layer_block,
    layer_count,
    lm_head,
)


@dataclass
class HeadConfig:
    family: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int  # the target's
    head_dim: Optional[int] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    bias: bool = False  # fc has a bias (EAGLE-1, early speculators EAGLE-3)
    attention_bias: bool = False  # q/k/v biases (Qwen2-style heads)
    draft_vocab_size: Optional[int] = None  # EAGLE-3
    target_hidden_size: Optional[int] = None  # EAGLE-3
    taps: Optional[List[int]] = None  # EAGLE-3: the states entering these target layers
    rope_scaling: Optional[dict] = None
    norm_before_residual: bool = False  # EAGLE-3 (speculators): the residual is hidden_norm(hidden)
    norm_before_fc: bool = False  # EAGLE-3 (speculators, gpt-oss heads): input_norm over the taps before fc
    extra: dict = field(default_factory=dict)

    def layer_args(self) -> llama.ModelArgs:
        return llama.ModelArgs(
            model_type="llama", hidden_size=self.hidden_size, num_hidden_layers=1,
            intermediate_size=self.intermediate_size, num_attention_heads=self.num_attention_heads,
            rms_norm_eps=self.rms_norm_eps, vocab_size=self.vocab_size,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
        )


def _attention(config: HeadConfig, width: int) -> nn.Module:
    """Llama attention reading ``width`` inputs; q/k/v biases as Qwen2-style heads carry them."""
    args = config.layer_args()
    attn = llama.Attention(args)
    head_dim = args.head_dim or config.hidden_size // config.num_attention_heads
    bias = config.attention_bias
    attn.q_proj = nn.Linear(width, config.num_attention_heads * head_dim, bias=bias)
    attn.k_proj = nn.Linear(width, config.num_key_value_heads * head_dim, bias=bias)
    attn.v_proj = nn.Linear(width, config.num_key_value_heads * head_dim, bias=bias)
    return attn


class Eagle1Layer(nn.Module):
    """A Llama decoder layer without input_layernorm: fc's output goes straight in."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        args = config.layer_args()
        self.self_attn = _attention(config, config.hidden_size)
        self.mlp = llama.MLP(args)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Eagle3Layer(nn.Module):
    """EAGLE-3's midlayer: attention over [normed embedding, normed hidden], 2H wide."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        args = config.layer_args()
        hidden = config.hidden_size
        self.self_attn = _attention(config, 2 * hidden)
        self.mlp = llama.MLP(args)
        self.input_layernorm = nn.RMSNorm(hidden, eps=config.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(hidden, eps=config.rms_norm_eps)


def embed(head: nn.Module, target: nn.Module, tokens: mx.array) -> mx.array:
    """Token embeddings: the head's own when its checkpoint has one that differs from the
    target's, else the target's."""
    return (head.embed_tokens if "embed_tokens" in head else embedding_layer(target))(tokens)


class Eagle1Head(nn.Module):
    family = "eagle1"
    draft_vocabulary = False  # drafts over the target's whole vocabulary, through its LM head
    layer_prefix = "layers.0"  # its layer's key prefix in the official layout
    architecture = "EagleLlamaForCausalLM"  # config.json's architectures, as this package writes it
    official_architecture = "LlamaForCausalLM"  # ... as the official EAGLE code writes it
    traceable = True  # its step is array code only: a whole tree can be drafted in one compiled call (tree_growth.py)

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=config.bias)
        self.layers = [Eagle1Layer(config)]

    def taps(self, num_target_layers: int) -> None:
        return None  # the post-norm last hidden state

    def project(self, features: mx.array) -> mx.array:
        return features

    def step(self, target: nn.Module, hidden: mx.array, tokens: mx.array, cache: List,
             positions: Positions, mask: Mask) -> mx.array:
        embedding = embed(self, target, tokens)
        x = self.fc(mx.concatenate([embedding, hidden.astype(embedding.dtype)], axis=-1))
        return layer_block(self.layers[0], x, x, cache[0], positions, mask)

    def logits(self, target: nn.Module, hidden: mx.array) -> mx.array:
        return lm_head(target, hidden)

    def target_ids(self, draft_ids: mx.array) -> mx.array:
        return draft_ids


def _eagle3_inputs(layer: nn.Module, embedding: mx.array, hidden: mx.array) -> mx.array:
    """What EAGLE-3's attention reads: [normed embedding, normed hidden]."""
    return mx.concatenate([layer.input_layernorm(embedding.astype(hidden.dtype)), layer.hidden_norm(hidden)], axis=-1)


class Eagle3Head(nn.Module):
    family = "eagle3"
    draft_vocabulary = True  # drafts over a vocabulary of its own, mapped to the target's by d2t
    layer_prefix = "midlayer"
    architecture = "Eagle3LlamaForCausalLM"
    official_architecture = "LlamaForCausalLMEagle3"
    traceable = True

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        target_hidden = config.target_hidden_size or config.hidden_size
        if config.norm_before_fc:
            self.input_norm = nn.RMSNorm(3 * target_hidden, eps=config.rms_norm_eps)
        self.fc = nn.Linear(3 * target_hidden, config.hidden_size, bias=config.bias)
        self.midlayer = Eagle3Layer(config)
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        draft_vocab = config.draft_vocab_size or config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, draft_vocab, bias=False)
        self.d2t = mx.zeros((draft_vocab,), dtype=mx.int64)

    def taps(self, num_target_layers: int) -> Tuple[int, ...]:
        return tuple(self.config.taps or default_taps(num_target_layers))

    def project(self, features: mx.array) -> mx.array:
        return self.fc(self.input_norm(features) if "input_norm" in self else features)

    def step(self, target: nn.Module, hidden: mx.array, tokens: mx.array, cache: List,
             positions: Positions, mask: Mask) -> mx.array:
        layer = self.midlayer
        x = compiled_piece(layer, _eagle3_inputs, tokens.shape[1])(embed(self, target, tokens), hidden)
        residual = layer.hidden_norm(hidden) if self.config.norm_before_residual else hidden
        return layer_block(layer, residual, x, cache[0], positions, mask)

    def logits(self, target: nn.Module, hidden: mx.array) -> mx.array:
        return self.lm_head(self.norm(hidden))

    def target_ids(self, draft_ids: mx.array) -> mx.array:
        return draft_ids + self.d2t[draft_ids]


class Head(Protocol):
    """What the decoder, drafter and trainer ask of a draft head (Eagle1Head, Eagle3Head,
    and the tests' oracle heads)."""

    family: str

    def taps(self, num_target_layers: int) -> Optional[Tuple[int, ...]]:
        """The target layers whose entering states are its features (None: the last state)."""

    def project(self, features: mx.array) -> mx.array:
        """Target features [..., F] -> the head's input width."""

    def step(self, target: nn.Module, hidden: mx.array, tokens: mx.array, cache: List,
             positions: Positions, mask: Mask) -> mx.array:
        """One forward of the head's layer over (hidden, next token) pairs, appending to ``cache``."""

    def logits(self, target: nn.Module, hidden: mx.array) -> mx.array:
        """Draft logits over the head's vocabulary."""

    def target_ids(self, draft_ids: mx.array) -> mx.array:
        """Draft-vocabulary ids -> the target's."""


EagleHead = Union[Eagle1Head, Eagle3Head]  # the heads with weights: saved, loaded, trained
HEADS = {head.family: head for head in (Eagle1Head, Eagle3Head)}  # by config.json's "family"


def new_head(target: nn.Module, family: str, draft_vocab_size: Optional[int] = None, seed: int = 0) -> EagleHead:
    """A randomly initialised head shaped for ``target`` (for training, and for tests:
    a bad head must still give exactly the target's text)."""
    if family not in HEADS:
        raise UserError(f"unknown head family {family!r}; use one of {', '.join(HEADS)}")
    args = target.args
    config = HeadConfig(
        family=family, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_key_value_heads,
        vocab_size=args.vocab_size, head_dim=getattr(args, "head_dim", None),
        rms_norm_eps=next(getattr(args, name) for name in ("rms_norm_eps", "norm_eps", "layer_norm_epsilon")
                          if hasattr(args, name)),
        rope_theta=getattr(args, "rope_theta", 10000.0),
        max_position_embeddings=getattr(args, "max_position_embeddings", 8192),
    )
    if HEADS[family].draft_vocabulary:
        config.target_hidden_size = args.hidden_size
        config.draft_vocab_size = draft_vocab_size or args.vocab_size
        config.taps = list(default_taps(layer_count(target)))
    mx.random.seed(seed)
    head = HEADS[family](config)
    if head.draft_vocabulary and config.draft_vocab_size < args.vocab_size:
        # Any sorted subset of the target vocabulary will do for a fresh head.
        used = mx.sort(mx.random.permutation(args.vocab_size)[: config.draft_vocab_size])
        head.d2t = (used - mx.arange(config.draft_vocab_size)).astype(mx.int64)
    head.set_dtype(compute_dtype(target))
    check_fits(head, target, "a new head")
    mx.eval(head.parameters())
    return head


def save_head(head: EagleHead, path: Path, dtype: Optional[mx.Dtype] = None) -> None:
    """Write config.json + model.safetensors in the official key layout; ``dtype`` casts the
    floating-point weights (float16 halves a shipped head; loading widens it again on CPU)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in asdict(head.config).items() if k != "extra"}
    config.update(head.config.extra)
    config["num_hidden_layers"] = 1
    config["architectures"] = [head.architecture]
    (path / "config.json").write_text(json.dumps(config, indent=2))
    weights = dict(tree_flatten(head.parameters()))
    if dtype is not None:
        weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    mx.save_safetensors(str(path / "model.safetensors"), weights)


TARGET_FILE = "target.json"  # beside a shipped head: the identity of the model it drafts for


def shipped_head_dir(model: nn.Module) -> Optional[Path]:
    """The head shipped for ``model`` (in the package's weights/ folder), if any."""

    identity = target_identity(model)
    for directory in sorted((Path(__file__).parent / "weights").glob("*")):
        try:
            if read_json(directory / TARGET_FILE) == identity:
                return directory
        except ValueError:
            continue
    return None


def read_head_weights(path: Path) -> Tuple[dict, Dict[str, mx.array]]:
    """A head directory's config.json (with its family) and tensors, or one clear line
    saying what is missing or damaged."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"draft head {path} does not exist; pass an EAGLE head directory")
    raw = read_config(path, "an EAGLE head directory")
    raw.setdefault("family", "eagle3" if raw.get("draft_vocab_size") else "eagle1")
    if not isinstance(raw["family"], str) or raw["family"] not in HEADS:
        raise UserError(f"{path}: unknown head family {raw['family']!r}")
    return raw, read_safetensors(path)


def read_safetensors(path: Path) -> Dict[str, mx.array]:
    """Every tensor of a drafter directory's .safetensors files, or one line saying there
    are none or which is damaged."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise UserError(f"{path} has no .safetensors weights")
    weights = {}
    for file in files:
        try:
            weights.update(mx.load(str(file)))
        except Exception as exc:
            raise UserError(f"{file} is damaged or truncated ({exc})") from exc
    return weights


_SIZES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
          "max_position_embeddings")
_OPTIONAL_SIZES = ("head_dim", "draft_vocab_size", "target_hidden_size")
_FLAGS = ("bias", "attention_bias", "norm_before_residual", "norm_before_fc")
QUANTIZATIONS = {"bits": (2, 3, 4, 5, 6, 8), "group_size": (32, 64, 128)}  # what MLX's quantized matmul takes


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_head_config(raw: dict, file: Path) -> HeadConfig:
    """A head's config.json as a HeadConfig, every field of the right type and range, or
    one line naming the first one that is not."""
    def bad(name: str, wanted: str) -> UserError:
        return UserError(f"{file}: {name} is {raw.get(name)!r}; it must be {wanted}")

    missing = [n for n in _SIZES[:5] if n not in raw]
    if missing:
        raise UserError(f"{file} lacks {', '.join(missing)}; is this an EAGLE head's config.json?")
    for name in _SIZES + _OPTIONAL_SIZES:
        if name in raw and not (raw[name] is None and name in _OPTIONAL_SIZES) \
                and not (_is_int(raw[name]) and 0 < raw[name] <= 1 << 24):
            raise bad(name, "a positive integer")
    for name in ("rms_norm_eps", "rope_theta"):
        value = raw.get(name, 1.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e12:
            raise bad(name, "a positive number")
    for name in _FLAGS:
        if not isinstance(raw.get(name, False), bool):
            raise bad(name, "true or false")
    if raw["num_attention_heads"] % raw["num_key_value_heads"]:
        raise bad("num_key_value_heads", f"a divisor of num_attention_heads ({raw['num_attention_heads']})")
    if raw.get("head_dim") is None and raw["hidden_size"] % raw["num_attention_heads"]:
        raise bad("num_attention_heads", f"a divisor of hidden_size ({raw['hidden_size']}), or give head_dim")
    taps = raw.get("taps")
    if taps is not None and not (isinstance(taps, list) and taps and all(_is_int(t) and t >= 0 for t in taps)):
        raise bad("taps", "a list of target layer numbers")
    quantization = raw.get("quantization")
    if quantization is not None and not (isinstance(quantization, dict) and all(
            quantization.get(k) in allowed and _is_int(quantization.get(k)) for k, allowed in QUANTIZATIONS.items())):
        raise bad("quantization", "an object with bits in 2, 3, 4, 5, 6, 8 and group_size in 32, 64, 128")
    rope_scaling = raw.get("rope_scaling")
    if rope_scaling is not None and not isinstance(rope_scaling, dict):
        raise bad("rope_scaling", "an object or null")
    known = set(HeadConfig.__dataclass_fields__) - {"extra"}
    config = HeadConfig(**{k: v for k, v in raw.items() if k in known},
                        extra={k: v for k, v in raw.items() if k not in known})
    if rope_scaling is not None:

        dims = config.head_dim or config.hidden_size // config.num_attention_heads
        try:
            initialize_rope(dims, config.rope_theta, False, rope_scaling, config.max_position_embeddings)
        except (KeyError, TypeError, ValueError) as exc:
            raise bad("rope_scaling", f"a rope scaling mlx-lm knows, with all its fields ({type(exc).__name__}: "
                                      f"{exc})") from None
    return config


def _mismatch(path: Path, head: nn.Module, weights: Dict[str, mx.array], config: HeadConfig) -> Optional[str]:
    """What is wrong between a head's weights and what its config.json builds, in one line
    (None: they match)."""
    expected = dict(tree_flatten(head.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    shapes = sorted(k for k in set(expected) & set(weights) if tuple(expected[k].shape) != tuple(weights[k].shape))
    if not (missing or unexpected or shapes):
        return None
    other = next((h for h in HEADS.values() if h.family != config.family
                  and any(k.startswith(h.layer_prefix + ".") for k in weights)), None)
    if other is not None:
        why = (f"the weights are an {other.family} head's ({other.layer_prefix}.*): set \"family\": "
               f"\"{other.family}\" in config.json")
    elif any(k.endswith(".scales") for k in unexpected):
        why = "the weights are quantized but config.json has no \"quantization\" (bits, group_size)"
    elif any(k.endswith(".scales") for k in missing):
        why = "config.json says quantized but the weights are not: remove its \"quantization\""
    else:
        parts = [f"{len(missing)} missing (e.g. {missing[0]})" if missing else "",
                 f"{len(unexpected)} not in the config (e.g. {unexpected[0]})" if unexpected else "",
                 f"{len(shapes)} of other shapes (e.g. {shapes[0]}: {tuple(weights[shapes[0]].shape)} vs "
                 f"{tuple(expected[shapes[0]].shape)})" if shapes else ""]
        why = "tensors " + ", ".join(p for p in parts if p)
    return f"{path}: the weights do not match its config.json: {why}"


def load_head(path: Path, target: nn.Module) -> EagleHead:
    """Load a head directory (config.json + safetensors) and check it fits ``target``."""
    path = Path(path)
    raw, weights = read_head_weights(path)
    config = check_head_config(raw, path / "config.json")
    head = HEADS[config.family](config)
    if "embed_tokens.weight" in weights:
        head.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
    if config.extra.get("quantization") is not None:
        q = config.extra["quantization"]
        nn.quantize(head, group_size=q["group_size"], bits=q["bits"],
                    class_predicate=lambda p, m: f"{p}.scales" in weights)
    check_fits(head, target, path)
    problem = _mismatch(path, head, weights, config)
    if problem:
        raise UserError(problem)
    head.load_weights(list(weights.items()), strict=True)
    if mx.default_device() == mx.cpu:
        # As the target's weights are widened on a CPU: MLX's quantized matmuls there run
        # ~3x slower than float32 (a draft step of the 8-bit SmolLM2 head: 11.5 vs 3.4 ms).
        dequantize_model(head)
    head.set_dtype(compute_dtype(target), predicate=lambda d: mx.issubdtype(d, mx.floating))
    if head.draft_vocabulary:
        check_draft_vocabulary(head.d2t, target.args.vocab_size, path)
    mx.eval(head.parameters())
    head.directory = path  # where tuned trees for it live (see tune.py)
    return head


def check_draft_vocabulary(d2t: mx.array, vocab_size: int, source, t2d: Optional[mx.array] = None) -> None:
    """d2t must map into the target's vocabulary (and agree with t2d, when given)."""
    targets = mx.arange(d2t.shape[0]) + d2t
    if mx.min(targets).item() < 0 or mx.max(targets).item() >= vocab_size:
        raise UserError(f"{source}: d2t maps draft tokens outside the target's vocabulary of {vocab_size}; "
                        "the head was made for another model")
    if t2d is not None and (t2d.shape[0] != vocab_size or int(t2d.astype(mx.int32).sum().item()) != d2t.shape[0]
                            or not bool(t2d[targets].all().item())):
        raise UserError(f"{source}: t2d and d2t disagree on the draft vocabulary; the checkpoint is inconsistent")


def check_fits(head: EagleHead, target: nn.Module, path) -> None:
    """Name exactly what does not match between a head and its target."""
    config, args = head.config, target.args
    problems = []
    if config.vocab_size != args.vocab_size:
        problems.append(f"vocabulary {config.vocab_size} vs the target's {args.vocab_size}")
    wanted = config.target_hidden_size or config.hidden_size
    if wanted != args.hidden_size:
        problems.append(f"hidden size {wanted} vs the target's {args.hidden_size}")
    elif "embed_tokens" not in head and config.hidden_size != args.hidden_size:
        problems.append(f"width {config.hidden_size} vs the target's embeddings of {args.hidden_size}, "
                        "and no embedding of its own")
    layers = layer_count(target)
    bad = [t for t in head.taps(layers) or () if not 0 <= t < layers]
    if bad:
        problems.append(f"feature taps {bad} outside the target's {layers} layers")
    if problems:
        raise UserError(f"draft head {path} does not fit this target: {'; '.join(problems)}")
