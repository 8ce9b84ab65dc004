"""Read a GGUF file's model: a Hugging Face config and tensors under Hugging Face names."""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..architectures import GGUF_ARCHITECTURES, architecture, text_config
from ..configs import check_model_config
from ..errors import UserError
from .tensors import QuantizedWeight, SourceTensor

try:
    import gguf
    from gguf import GGMLQuantizationType as QT
except ImportError as exc:  # pragma: no cover - gguf is a declared dependency
    raise ImportError("reading GGUF files needs the 'gguf' package: pip install gguf") from exc


# GGUF architecture -> its record (architectures.py). Mistral GGUFs are written as "llama";
# mixture-of-experts ones are refused (their targets run here from other formats).
ARCHITECTURES = {name: record for name, record in GGUF_ARCHITECTURES.items() if not record.experts}

FLOAT_TYPES = {QT.F32, QT.F16, QT.BF16}

# Block formats that are MLX affine quantization with group 32 and float16
# scale/bias, exactly: value = d * q + m. Their bits:
NATIVE_BITS = {QT.Q4_0: 4, QT.Q4_1: 4, QT.Q5_0: 5, QT.Q5_1: 5, QT.Q8_0: 8}

# Super-block formats with 6-bit sub-scales: MLX cannot hold them exactly, so
# with no format asked for they are re-quantized at these widths (never fewer
# bits than the source carries).
REQUANTIZE_BITS = {QT.Q2_K: 3, QT.Q3_K: 4, QT.Q4_K: 4, QT.Q5_K: 5, QT.Q6_K: 6}

SUPPORTED_TYPES = FLOAT_TYPES | set(NATIVE_BITS) | set(REQUANTIZE_BITS)

_TENSOR_NAMES = [
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"token_embd_norm\.weight", "model.embedding_norm.weight"),  # LFM2's final norm
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.(weight)", r"model.layers.\1.input_layernorm.\2"),
    (r"blk\.(\d+)\.attn_q\.(weight|bias)", r"model.layers.\1.self_attn.q_proj.\2"),
    (r"blk\.(\d+)\.attn_k\.(weight|bias)", r"model.layers.\1.self_attn.k_proj.\2"),
    (r"blk\.(\d+)\.attn_v\.(weight|bias)", r"model.layers.\1.self_attn.v_proj.\2"),
    (r"blk\.(\d+)\.attn_output\.(weight|bias)", r"model.layers.\1.self_attn.o_proj.\2"),
    (r"blk\.(\d+)\.attn_q_norm\.(weight)", r"model.layers.\1.self_attn.q_norm.\2"),
    (r"blk\.(\d+)\.attn_k_norm\.(weight)", r"model.layers.\1.self_attn.k_norm.\2"),
    (r"blk\.(\d+)\.ffn_norm\.(weight)", r"model.layers.\1.post_attention_layernorm.\2"),
    (r"blk\.(\d+)\.ffn_gate\.(weight)", r"model.layers.\1.mlp.gate_proj.\2"),
    (r"blk\.(\d+)\.ffn_up\.(weight)", r"model.layers.\1.mlp.up_proj.\2"),
    (r"blk\.(\d+)\.ffn_down\.(weight)", r"model.layers.\1.mlp.down_proj.\2"),
]


def hf_name(gguf_name: str, renamed: Tuple[Tuple[str, str], ...] = (), layers: str = "model.layers") -> Optional[str]:
    """Our name for a GGUF tensor; ``renamed``: an architecture's own meanings of llama.cpp's
    names (its record's gguf_names: whole names, or block name parts, some with no
    weight/bias suffix, as Mamba-2's A and D); ``layers``: where its blocks go."""
    for part, ours in renamed:
        if gguf_name == part:
            return ours
        found = re.fullmatch(rf"blk\.(\d+)\.{re.escape(part)}(?:\.(weight|bias))?", gguf_name)
        if found:
            suffix = f".{found.group(2)}" if found.group(2) else ""
            return f"{layers}.{found.group(1)}.{ours}{suffix}"
    for pattern, replacement in _TENSOR_NAMES:
        if re.fullmatch(pattern, gguf_name):
            return re.sub(pattern, replacement, gguf_name).replace("model.layers.", f"{layers}.")
    return None


# GGUF value types: fixed sizes in bytes (8: a string, 9: an array).
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def check_gguf_layout(path: Path) -> None:
    """Walk a GGUF file's header, metadata and tensor index, checking every count and
    length it declares against the bytes the file has, before gguf.GGUFReader (which
    believes them: a 69-byte file declaring an array of 10**12 values made it allocate
    without bound). One line for the first that cannot fit."""

    size = path.stat().st_size
    with open(path, "rb") as file:
        def read(count: int) -> bytes:
            if count < 0 or file.tell() + count > size:
                raise UserError(f"{path} declares {count:,} bytes at offset {file.tell():,} of a {size:,}-byte file; "
                                "it is damaged or truncated")
            return file.read(count)

        def number(fmt: str) -> int:
            return struct.unpack("<" + fmt, read(struct.calcsize(fmt)))[0]

        def skip_value(kind: int, depth: int = 0) -> None:
            if kind in _GGUF_SIZES:
                read(_GGUF_SIZES[kind])
            elif kind == 8:
                read(number("Q"))
            elif kind == 9 and depth < 4:
                element, count = number("I"), number("Q")
                if element in _GGUF_SIZES:
                    read(count * _GGUF_SIZES[element])  # checked against the file before anything is read
                elif element in (8, 9):
                    if count > (size - file.tell()) // 8:
                        raise UserError(f"{path} declares an array of {count:,} values that its {size:,} bytes "
                                        "cannot hold; it is damaged")
                    for _ in range(count):
                        skip_value(element, depth + 1)
                else:
                    raise UserError(f"{path} holds a metadata array of unknown type {element}; it is damaged")
            else:
                raise UserError(f"{path} holds metadata of unknown type {kind}; it is damaged")

        read(4)
        version = number("I")
        counts = "I" if version == 1 else "Q"
        tensors, fields = number(counts), number(counts)
        if tensors > size // 24 or fields > size // 12:
            raise UserError(f"{path} declares {tensors:,} tensors and {fields:,} metadata fields, more than its "
                            f"{size:,} bytes can hold; it is damaged")
        for _ in range(fields):
            read(number("Q"))  # the key
            skip_value(number("I"))
        for _ in range(tensors):
            read(number("Q"))  # the name
            dims = number("I")
            if dims > 8:
                raise UserError(f"{path} declares a tensor of {dims} dimensions; it is damaged")
            read(8 * dims + 12)


def open_gguf(path: Path) -> "gguf.GGUFReader":
    """Open a GGUF file, turning every way it can be broken into one UserError."""
    try:
        with open(path, "rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}") from exc
    if magic != b"GGUF":
        raise UserError(f"{path} is not a GGUF file (its first bytes are {magic!r}, not b'GGUF')")
    check_gguf_layout(path)
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:
        raise UserError(f"{path} is a damaged or truncated GGUF file ({exc}); download it again") from exc
    return reader


def field(reader, key: str, default: Any = None) -> Any:
    """A metadata value, ``default`` when absent, one line when it cannot be decoded."""
    entry = reader.fields.get(key)
    if entry is None:
        return default
    try:
        return entry.contents()
    except Exception as exc:  # bytes that are not what their type says: a damaged file
        raise UserError(f"the GGUF metadata {key} is damaged ({type(exc).__name__}); download the file again") from None


def number(reader, key: str, kind: type = int, default: Any = None) -> Any:
    """A numeric metadata value as ``kind``; one line when it is missing or not a number."""
    value = field(reader, key, default)
    if value is None:
        raise UserError(f"the GGUF file has no {key}; it is damaged or not a model")
    try:
        return kind(value)
    except (TypeError, ValueError, OverflowError):
        raise UserError(f"the GGUF metadata {key} is {str(value)[:40]!r}, not a number") from None


def gguf_config(reader, path: Path) -> Dict[str, Any]:
    """The Hugging Face config.json equivalent of a GGUF file's metadata."""
    arch = field(reader, "general.architecture")
    experts = arch in GGUF_ARCHITECTURES and GGUF_ARCHITECTURES[arch].experts
    if experts or any("_exps." in t.name for t in reader.tensors):
        raise UserError(
            f"{path}: mixture-of-experts GGUF files ({arch}) are not converted here; pass the model's Hugging Face "
            "directory to mlx_eagle.convert, or an MLX conversion of it to --model (both decode with EAGLE)"
        )
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise UserError(
            f"{path}: GGUF architecture {arch!r} is not supported (from GGUF: "
            f"{', '.join(sorted(ARCHITECTURES))}; Mistral GGUFs use 'llama'); pass the model's Hugging Face directory "
            "to mlx_eagle.convert, or an MLX conversion of it to --model"
        )
    tokens = field(reader, "tokenizer.ggml.tokens") or []
    hidden = number(reader, f"{arch}.embedding_length")
    config = {
        "model_type": ARCHITECTURES[arch].model_type,
        "architectures": [ARCHITECTURES[arch].hf_class],
        "hidden_size": hidden,
        "num_hidden_layers": number(reader, f"{arch}.block_count"),
        "max_position_embeddings": number(reader, f"{arch}.context_length", int, 4096),
        "vocab_size": number(reader, f"{arch}.vocab_size", int, len(tokens)),
        "tie_word_embeddings": "output.weight" not in {t.name for t in reader.tensors},
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id"),
    }
    if ARCHITECTURES[arch].gguf_mamba2:
        config.update(_mamba2_config(reader, arch, config))
    elif ARCHITECTURES[arch].gguf_gated_delta:
        config.update(_gated_delta_config(reader, arch, config))
    else:
        heads = number(reader, f"{arch}.attention.head_count")
        config.update({
            "intermediate_size": number(reader, f"{arch}.feed_forward_length"),
            "num_attention_heads": heads,
            # (LFM2 writes one per layer: _lfm2_config)
            "num_key_value_heads": None if arch == "lfm2" else number(reader, f"{arch}.attention.head_count_kv", int,
                                                                      heads),
            "head_dim": number(reader, f"{arch}.attention.key_length", int, hidden // max(heads, 1)),
            "rms_norm_eps": number(reader, f"{arch}.attention.layer_norm_rms_epsilon", float, 1e-6),
            "rope_theta": number(reader, f"{arch}.rope.freq_base", float, 10000.0),
        })
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in {t.name for t in reader.tensors}
        config["mlp_bias"] = False
    if arch == "gemma3":
        config.update(_gemma3_config(reader, config))
    if arch == "lfm2":
        config.update(_lfm2_config(reader, config))
    eot = field(reader, "tokenizer.ggml.eot_token_id")  # chat models end a turn on it (Gemma's <end_of_turn>)
    if isinstance(eot, int) and eot != config.get("eos_token_id"):
        config["eos_token_id"] = [config["eos_token_id"], eot] if config.get("eos_token_id") is not None else eot
    rope_freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if rope_freqs is not None:
        dims = number(reader, f"{arch}.rope.dimension_count", int, config["head_dim"])
        original = field(reader, f"{arch}.rope.scaling.original_context_length")
        config["rope_scaling"] = llama3_rope_scaling(np.asarray(rope_freqs.data, dtype=np.float64).reshape(-1),
                                                     config["rope_theta"], dims, original, path)
    config = {k: v for k, v in config.items() if v is not None}
    check_model_config(config, path, path.stat().st_size, llama_shaped=ARCHITECTURES[arch].llama_shaped)
    return config


def _gated_delta_config(reader, arch: str, config: Dict[str, Any]) -> Dict[str, Any]:
    """Qwen3.5's settings (mlx-lm reads a flat config as its text model's). llama.cpp writes
    the Gated DeltaNet's sizes under ssm.* (key heads as groups, their width as the state,
    value heads as the time-step rank), the partial RoPE as a dimension count and its
    sections, and the layers a model carries for multi-token prediction past the others."""
    heads = number(reader, f"{arch}.attention.head_count")
    head_dim = number(reader, f"{arch}.attention.key_length", int, config["hidden_size"] // max(heads, 1))
    value_heads = number(reader, f"{arch}.ssm.time_step_rank")
    inner = number(reader, f"{arch}.ssm.inner_size")
    if value_heads <= 0 or inner % value_heads:
        raise UserError(f"the GGUF file's ssm.inner_size {inner} is not a multiple of its {value_heads} value heads; "
                        "it is damaged")
    kv_heads = field(reader, f"{arch}.attention.head_count_kv", heads)
    sections = field(reader, f"{arch}.rope.dimension_sections") or [11, 11, 10]
    return {
        "num_hidden_layers": config["num_hidden_layers"] - number(reader, f"{arch}.nextn_predict_layers", int, 0),
        "intermediate_size": number(reader, f"{arch}.feed_forward_length"),
        "num_attention_heads": heads, "head_dim": head_dim,
        "num_key_value_heads": max(kv_heads) if isinstance(kv_heads, list) else kv_heads,
        "rms_norm_eps": number(reader, f"{arch}.attention.layer_norm_rms_epsilon", float, 1e-6),
        "linear_num_key_heads": number(reader, f"{arch}.ssm.group_count"),
        "linear_key_head_dim": number(reader, f"{arch}.ssm.state_size"),
        "linear_num_value_heads": value_heads, "linear_value_head_dim": inner // value_heads,
        "linear_conv_kernel_dim": number(reader, f"{arch}.ssm.conv_kernel"),
        "full_attention_interval": number(reader, f"{arch}.full_attention_interval", int, 4),
        "rope_parameters": {"type": "default", "mrope_section": [int(n) for n in sections[:3]],
                            "rope_theta": number(reader, f"{arch}.rope.freq_base", float, 10000000.0),
                            "partial_rotary_factor": number(reader, f"{arch}.rope.dimension_count", int,
                                                            head_dim // 4) / head_dim},
    }


def _per_layer(reader, key: str, layers: int) -> List[int]:
    """A metadata value llama.cpp writes per layer (or one for all): one number per layer."""
    value = field(reader, key)
    values = value if isinstance(value, list) else [value] * layers
    if len(values) != layers or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise UserError(f"the GGUF file's {key} is not one whole number per layer; it is damaged")
    return values


def _mamba2_config(reader, arch: str, config: Dict[str, Any]) -> Dict[str, Any]:
    """Mamba 2's, Nemotron-H's and Granite 4 hybrids' settings. llama.cpp writes the mixer's
    sizes under ssm.* (its time-step rank is the head count), which layers attend (key/value
    heads per layer), and for Nemotron-H which are MLPs (feed-forward width per layer): the
    rest are Mamba."""
    heads = number(reader, f"{arch}.ssm.time_step_rank")
    inner = number(reader, f"{arch}.ssm.inner_size")
    if heads <= 0 or inner % heads:
        raise UserError(f"the GGUF file's ssm.inner_size {inner} is not a multiple of its {heads} heads; it is damaged")
    names = {t.name for t in reader.tensors}
    ssm = {"ssm_state_size": number(reader, f"{arch}.ssm.state_size"),
           "conv_kernel": number(reader, f"{arch}.ssm.conv_kernel"),
           "n_groups": number(reader, f"{arch}.ssm.group_count", int, 1),
           "layer_norm_epsilon": number(reader, f"{arch}.attention.layer_norm_rms_epsilon", float, 1e-5),
           "use_conv_bias": any(n.endswith("ssm_conv1d.bias") for n in names),
           "time_step_limit": [0.0, float("inf")]}
    if arch == "mamba2":
        return dict(ssm, num_heads=heads, head_dim=inner // heads, intermediate_size=inner,
                    state_size=ssm["ssm_state_size"], use_bias=any(n.endswith("ssm_in.bias") for n in names),
                    time_step_rank="auto")
    layers = config["num_hidden_layers"]
    kv_heads = _per_layer(reader, f"{arch}.attention.head_count_kv", layers)
    attention_heads = number(reader, f"{arch}.attention.head_count")
    if arch == "granitehybrid":  # its multipliers under llama.cpp's names; RoPE where rope.scaling.finetuned says
        return {"layer_types": ["attention" if k else "mamba" for k in kv_heads],
                "num_attention_heads": attention_heads, "num_key_value_heads": max(kv_heads) or attention_heads,
                "intermediate_size": number(reader, f"{arch}.feed_forward_length"),
                "rms_norm_eps": ssm["layer_norm_epsilon"],
                "rope_theta": number(reader, f"{arch}.rope.freq_base", float, 10000.0),
                "position_embedding_type": "rope" if field(reader, f"{arch}.rope.scaling.finetuned") else "nope",
                "attention_bias": any(n.endswith("attn_q.bias") for n in names),
                "embedding_multiplier": number(reader, f"{arch}.embedding_scale", float, 1.0),
                "attention_multiplier": number(reader, f"{arch}.attention.scale", float, 1.0),
                "residual_multiplier": number(reader, f"{arch}.residual_scale", float, 1.0),
                "logits_scaling": number(reader, f"{arch}.logit_scale", float, 1.0),
                "mamba_n_heads": heads, "mamba_d_head": inner // heads, "mamba_d_state": ssm["ssm_state_size"],
                "mamba_expand": inner // config["hidden_size"],  # (which transformers' config checks)
                "mamba_d_conv": ssm["conv_kernel"], "mamba_n_groups": ssm["n_groups"],
                "mamba_conv_bias": ssm["use_conv_bias"],
                "mamba_proj_bias": any(n.endswith("ssm_in.bias") for n in names)}
    widths = _per_layer(reader, f"{arch}.feed_forward_length", layers)
    return dict(ssm, mamba_num_heads=heads, mamba_head_dim=inner // heads,
                hybrid_override_pattern="".join("*" if k else "-" if w else "M" for k, w in zip(kv_heads, widths)),
                num_attention_heads=attention_heads, num_key_value_heads=max(kv_heads) or attention_heads,
                head_dim=number(reader, f"{arch}.attention.key_length", int, config["hidden_size"] // attention_heads),
                intermediate_size=max(widths), attention_bias=any(n.endswith("attn_q.bias") for n in names),
                mlp_bias=any(n.endswith("ffn_up.bias") for n in names),
                mamba_proj_bias=any(n.endswith("ssm_in.bias") for n in names),
                use_bias=any(n.endswith("ssm_in.bias") for n in names))


def _lfm2_config(reader, config: Dict[str, Any]) -> Dict[str, Any]:
    """LFM2's own settings: llama.cpp writes key/value heads per layer (0: a short
    convolution), the convolution's cache length and the feed-forward width it computed."""
    per_layer = field(reader, "lfm2.attention.head_count_kv")
    if not isinstance(per_layer, list) or len(per_layer) != config["num_hidden_layers"]:
        raise UserError("the GGUF file's lfm2.attention.head_count_kv is not one number per layer; it is damaged")
    return {"num_key_value_heads": max(int(k) for k in per_layer) or config["num_attention_heads"],
            "layer_types": ["full_attention" if int(k) else "conv" for k in per_layer],
            "norm_eps": number(reader, "lfm2.attention.layer_norm_rms_epsilon", float, 1e-5),
            "conv_L_cache": number(reader, "lfm2.shortconv.l_cache"), "block_dim": config["hidden_size"],
            "block_ff_dim": config["intermediate_size"], "block_auto_adjust_ff_dim": False, "block_multiple_of": 256,
            "block_ffn_dim_multiplier": 1.0,
            "conv_bias": "blk.0.shortconv.conv.bias" in {t.name for t in reader.tensors}}


def _gemma3_config(reader, config: Dict[str, Any]) -> Dict[str, Any]:
    """What llama.cpp fixes for Gemma 3 instead of writing it: local layers' RoPE base
    10,000, a global layer every 6th, and the query scale 1/sqrt(head_dim), but
    1/sqrt(hidden / heads) for the 27B (62 layers); and the window and RoPE scaling it writes."""
    layers, heads, hidden = config["num_hidden_layers"], config["num_attention_heads"], config["hidden_size"]
    extra = {"sliding_window": number(reader, "gemma3.attention.sliding_window", int, 512),
             "sliding_window_pattern": 6, "rope_local_base_freq": 10000.0,
             "query_pre_attn_scalar": hidden // heads if layers == 62 else config["head_dim"]}
    factor = field(reader, "gemma3.rope.scaling.factor")
    if factor is not None and float(factor) != 1.0:
        kind = field(reader, "gemma3.rope.scaling.type", "linear")
        extra["rope_scaling"] = {"rope_type": kind, "factor": float(factor)}
    return extra


# Llama 3.1+ GGUFs carry their RoPE scaling as one divisor per frequency (llama.cpp's
# convert_hf_to_gguf computes it from the config's rope_scaling and drops the config).
ROPE_FREQS = "rope_freqs.weight"


def llama3_rope_factors(theta: float, dims: int, factor: float, low: float, high: float,
                        original: float) -> np.ndarray:
    """Llama 3's per-frequency RoPE divisors, as Hugging Face and mlx-lm compute them."""
    wavelengths = 2 * np.pi * theta ** (np.arange(0, dims, 2) / dims)
    smooth = (original / wavelengths - low) / (high - low)
    medium = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelengths > original / low, factor, np.where(wavelengths < original / high, 1.0, medium))


def llama3_rope_scaling(divisors: np.ndarray, theta: float, dims: int, original: Optional[int],
                        path: Path) -> Optional[Dict[str, Any]]:
    """The ``rope_scaling`` (rope_type llama3) that gives ``divisors``, or one line when none does.

    Between the frequencies left alone (divisor 1) and those divided by ``factor``, the
    smoothing s = (1/d - 1/factor) / (1 - 1/factor) is linear in 1/wavelength:
    s = original / (high - low) / wavelength - low / (high - low). A line fitted through
    those frequencies gives two of (low, high, original); the third is the GGUF's
    original context length when it records one, else low = 1, as in every Llama 3.x.
    The parameters found are checked by computing the divisors back."""
    factor = float(divisors.max())
    if divisors.shape != (dims // 2,) or not np.isfinite(divisors).all() or divisors.min() <= 0:
        raise UserError(f"{path}: {ROPE_FREQS} holds {divisors.size} values, not {dims // 2} positive ones; "
                        "the file is damaged")
    if factor <= 1 + 1e-6:
        return None
    wavelengths = 2 * np.pi * theta ** (np.arange(0, dims, 2) / dims)
    middle = (divisors > 1 + 1e-4) & (divisors < factor * (1 - 1e-4))
    scaling = None
    if middle.sum() >= 2:  # every Llama 3.x smooths several frequencies; fewer leave the line undetermined
        smooth = (1 / divisors[middle] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelengths[middle], smooth, 1)
        low, high = 1.0, 4.0
        if original:
            high_minus_low = original / slope
            low = -intercept * high_minus_low
            high = low + high_minus_low
        elif intercept < 0:
            high = 1 - 1 / intercept
            original = -slope / intercept
        if original:
            scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(f"{low:.6g}"),
                       "high_freq_factor": float(f"{high:.6g}"),
                       "original_max_position_embeddings": int(round(original))}
    if scaling is None or not np.allclose(
            llama3_rope_factors(theta, dims, factor, scaling["low_freq_factor"], scaling["high_freq_factor"],
                                scaling["original_max_position_embeddings"]), divisors, rtol=1e-4):
        raise UserError(f"{path}: its {ROPE_FREQS} is not a Llama 3 RoPE scaling this converter can rebuild; "
                        "convert the Hugging Face model directory instead")
    return scaling


def _unpermute_rows(n_heads: int, rows: int) -> np.ndarray:
    """Row order that undoes llama.cpp's Q/K permutation (see convert_hf_to_gguf.permute)."""
    return np.arange(rows).reshape(n_heads, rows // n_heads // 2, 2).swapaxes(1, 2).reshape(-1)


def _block_values(blocks: np.ndarray, qtype) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split GGUF blocks of 32 into (unsigned q [n, 32], scale d [n], bias [n]) so that
    value = d * q + bias, with d and bias as float32 holding exact float16 values."""
    def f16(column: np.ndarray) -> np.ndarray:
        return column.copy().view(np.float16)[:, 0].astype(np.float32)

    def nibbles(packed: np.ndarray) -> np.ndarray:
        return np.concatenate([packed & 0x0F, packed >> 4], axis=1)

    def high_bits(qh: np.ndarray) -> np.ndarray:
        return np.unpackbits(qh, axis=1, bitorder="little") << 4

    if qtype == QT.Q8_0:
        d = f16(blocks[:, 0:2])
        q = (blocks[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return q, d, -128.0 * d
    if qtype == QT.Q4_0:
        d = f16(blocks[:, 0:2])
        return nibbles(blocks[:, 2:18]), d, -8.0 * d
    if qtype == QT.Q4_1:
        return nibbles(blocks[:, 4:20]), f16(blocks[:, 0:2]), f16(blocks[:, 2:4])
    if qtype == QT.Q5_0:
        d = f16(blocks[:, 0:2])
        return nibbles(blocks[:, 6:22]) | high_bits(blocks[:, 2:6]), d, -16.0 * d
    if qtype == QT.Q5_1:
        q = nibbles(blocks[:, 8:24]) | high_bits(blocks[:, 4:8])
        return q, f16(blocks[:, 0:2]), f16(blocks[:, 2:4])
    raise ValueError(f"{qtype.name} has no exact MLX form")


def pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned q values [rows, cols] as MLX does: a little-endian bit stream in uint32."""
    stream = np.unpackbits(q[..., None], axis=-1, count=bits, bitorder="little")
    packed = np.packbits(stream.reshape(q.shape[0], -1), axis=-1, bitorder="little")
    return packed.view(np.uint32)


def native_quantized(data: np.ndarray, qtype, rows: int, cols: int) -> Optional[QuantizedWeight]:
    """A GGUF block-quantized matrix as the MLX quantized weight with the same values,
    or None when a scale does not fit float16 (then the caller re-quantizes)."""
    bits = NATIVE_BITS[qtype]
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    q, d, bias = _block_values(np.ascontiguousarray(data).reshape(-1, block_bytes), qtype)
    scales, biases = d.astype(np.float16), bias.astype(np.float16)
    if not (np.isfinite(scales).all() and np.isfinite(biases).all()):
        return None
    groups = cols // 32
    return QuantizedWeight(
        weight=mx.array(pack_bits(q.reshape(rows, cols), bits)),
        scales=mx.array(scales.reshape(rows, groups)),
        biases=mx.array(biases.reshape(rows, groups)),
        bits=bits,
        group_size=32,
    )


def dequantized(data: np.ndarray, qtype, shape: Tuple[int, ...]) -> mx.array:
    if qtype == QT.F32:
        return mx.array(np.asarray(data, dtype=np.float32).reshape(shape))
    if qtype == QT.F16:
        return mx.array(np.asarray(data).view(np.float16).reshape(shape))
    if qtype == QT.BF16:
        bits = np.asarray(data).view(np.uint16).reshape(shape)
        return mx.array(bits).view(mx.bfloat16)
    return mx.array(gguf.quants.dequantize(data, qtype).reshape(shape))


def read_tensors(reader, config: Dict[str, Any], path: Path) -> List[SourceTensor]:
    record = architecture(config["model_type"])
    layers = text_config(config).get("num_hidden_layers")
    tensors = []
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:  # in the config's rope_scaling (see gguf_config)
            continue
        block = re.match(r"blk\.(\d+)\.", tensor.name)
        if block and layers is not None and int(block.group(1)) >= layers:
            continue  # a multi-token-prediction layer past the model's own (mtp_model.py reads those elsewhere)
        name = hf_name(tensor.name, record.gguf_names, record.gguf_layers)
        if name is None:
            raise UserError(f"{path}: unexpected tensor {tensor.name!r} for a {config['model_type']} model")
        qtype = tensor.tensor_type
        if qtype not in SUPPORTED_TYPES:
            raise UserError(
                f"{path}: tensor {tensor.name} has GGUF type {qtype.name}, which is not supported; "
                f"supported are {', '.join(sorted(t.name for t in SUPPORTED_TYPES))}"
            )
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        if record.gguf_conv and name.endswith(record.gguf_conv) and len(shape) == 2:
            shape = shape + (1,)  # MLX's depthwise conv1d kernel: [channels, width, 1]
        order, transform = None, None
        if record.gguf_permuted and re.search(r"\.(q|k)_proj\.weight$", name):
            heads = config["num_attention_heads"] if ".q_proj" in name else config["num_key_value_heads"]
            order = _unpermute_rows(heads, shape[0])
        if record.gguf_mamba2:
            shape, transform = _mamba2_tensor(name, shape)
        if record.gguf_gated_delta:
            transform = _gated_delta_tensor(name, config)
        shift = record.gguf_norm_shift if name.endswith("norm.weight") else 0.0
        tensors.append(_source_tensor(name, tensor.data, qtype, shape, order, shift, transform))
    return tensors


def _mamba2_tensor(name: str, shape: Tuple[int, ...]) -> Tuple[Tuple[int, ...], Optional[Callable]]:
    """A Mamba-2 tensor's shape as Hugging Face's, and how its values are recovered from
    llama.cpp's: A was written as A = -exp(A_log), A and D as [heads, 1] columns, the gated
    norm's weight as [groups, inner / groups]."""
    if re.search(r"\.(mixer|mamba)\.A_log$", name):
        return (shape[0],), lambda a: mx.log(-a)
    if re.search(r"\.(mixer|mamba)\.(D|norm\.weight)$", name):
        return (int(np.prod(shape)),), None
    return shape, None


def _gated_delta_tensor(name: str, config: Dict[str, Any]) -> Optional[Callable]:
    """How a Gated DeltaNet tensor's values are recovered from llama.cpp's: A was written as
    -exp(A_log), and where there are more value heads than key heads, the value heads
    (rows of the value part of in_proj_qkv, of in_proj_z, in_proj_a, in_proj_b, A_log,
    dt_bias and the conv kernel's value channels, columns of out_proj) were tiled [k0, k1,
    ..., k0, k1, ...] rather than grouped by key head [k0, k0, ..., k1, k1, ...]."""
    key_heads, value_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    value_dim, key_part = config["linear_value_head_dim"], 2 * key_heads * config["linear_key_head_dim"]
    parts = {"in_proj_qkv.weight": (0, key_part, value_dim), "in_proj_z.weight": (0, 0, value_dim),
             "in_proj_a.weight": (0, 0, 1), "in_proj_b.weight": (0, 0, 1), "A_log": (0, 0, 1), "dt_bias": (0, 0, 1),
             "conv1d.weight": (0, key_part, value_dim), "out_proj.weight": (1, 0, value_dim)}
    part = next((p for suffix, p in parts.items() if name.endswith(f"linear_attn.{suffix}")), None)
    if part is None:
        return None
    axis, start, head_dim = part

    def grouped(values: mx.array) -> mx.array:
        if name.endswith("A_log"):
            values = mx.log(-values)
        if key_heads == value_heads:
            return values
        moved = mx.moveaxis(values, axis, 0)
        tail = moved[start:].reshape(value_heads // key_heads, key_heads, head_dim, *moved.shape[1:])
        moved = mx.concatenate([moved[:start], tail.swapaxes(0, 1).reshape(moved[start:].shape)])
        return mx.moveaxis(moved, 0, axis)

    return grouped


def _source_tensor(name, data, qtype, shape, order, shift: float = 0.0,
                   transform: Optional[Callable] = None) -> SourceTensor:
    """``shift``: subtracted from the values (llama.cpp's +1 on (1 + w) norm weights);
    ``transform``: what undoes llama.cpp's rewriting of the values."""
    def rows_in_order(array):
        return array if order is None else array[mx.array(order)]

    def load() -> mx.array:
        values = rows_in_order(dequantized(data, qtype, shape))
        values = transform(values) if transform is not None else values
        return values - shift if shift else values

    def load_native() -> Optional[QuantizedWeight]:
        native = native_quantized(data, qtype, *shape)
        if native is not None and order is not None:
            native.weight, native.scales, native.biases = (
                rows_in_order(a) for a in (native.weight, native.scales, native.biases)
            )
        return native

    is_native = qtype in NATIVE_BITS and len(shape) == 2 and transform is None
    return SourceTensor(
        name=name,
        shape=shape,
        load=load,
        load_native=load_native if is_native else None,
        native_bits=NATIVE_BITS[qtype] if is_native else None,
        requantize_bits=REQUANTIZE_BITS.get(qtype),
    )


def source_dtype(reader) -> Optional[mx.Dtype]:
    """The float dtype of an unquantized GGUF's matrices, or None if it is quantized."""
    matrix_types = {t.tensor_type for t in reader.tensors if len(t.shape) == 2}
    if matrix_types <= FLOAT_TYPES:
        if QT.F32 in matrix_types:
            return mx.float32
        return mx.bfloat16 if QT.BF16 in matrix_types else mx.float16
    return None
