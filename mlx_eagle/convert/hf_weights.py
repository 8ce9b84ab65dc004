"""Read a Hugging Face model directory: config.json, safetensors, tokenizer files."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx

from ..architectures import ARCHITECTURES, model_classes, text_config
from ..architectures import SUPPORTED_MODEL_TYPES as MODEL_TYPES
from ..configs import check_model_config, safetensors_bytes
from ..configs import read_config as read_config_json
from ..mtp_model import is_mtp, is_raw, quantized, sanitize_mtp
from ..errors import UserError
from .tensors import SourceTensor

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)

_TORCH_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def hf_config(path: Path) -> Dict[str, Any]:
    config = read_config_json(path, "a Hugging Face model directory")
    model_type = config.get("model_type")
    if model_type == "gpt_oss":  # its experts are MXFP4-packed or interleaved; mlx-lm's conversions unpack them
        raise UserError(f"{path}: gpt-oss checkpoints are not converted here; pass an MLX conversion of it "
                        "(such as mlx-community/gpt-oss-20b-MXFP4-Q8) to --model, which decodes with EAGLE")
    if model_type not in MODEL_TYPES:
        raise UserError(
            f"{path}: architecture {model_type!r} is not supported; supported are {', '.join(MODEL_TYPES)}"
        )
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer.model")):
        raise UserError(f"{path} has no tokenizer (tokenizer.json or tokenizer.model); copy it from the model's "
                        "repository")
    check_model_config(text_config(config), path / "config.json", safetensors_bytes(path),
                       llama_shaped=ARCHITECTURES[model_type].llama_shaped)
    return config


def read_tensors(path: Path, config: Dict[str, Any]) -> List[SourceTensor]:
    files = sorted(path.glob("model*.safetensors")) or sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(f"{path} has no .safetensors weights (PyTorch .bin checkpoints are not read for safety)")
    weights: Dict[str, mx.array] = {}
    for file in files:
        try:
            weights.update(mx.load(str(file)))
        except Exception as exc:
            raise UserError(f"{file} is damaged or truncated ({exc}); download it again") from exc

    layers = text_config(config).get("num_hidden_layers", 0)
    weights = {k: v for k, v in weights.items() if not is_mtp(k, config["model_type"], layers)}  # see mtp_tensors
    model_class, args_class = model_classes(config["model_type"])
    weights = model_class(args_class.from_dict(config)).sanitize(weights)
    return [
        SourceTensor(name=name, shape=tuple(value.shape), load=lambda value=value: value)
        for name, value in weights.items()
    ]


def mtp_tensors(path: Path, config: Dict[str, Any], dtype: mx.Dtype, bits: Optional[int] = None,
                group_size: int = 64) -> Dict[str, mx.array]:
    """The model's MTP module (mtp_model.py), which mlx-lm's sanitize drops, in mlx-lm's
    layout as ``dtype`` (its projections quantized to ``bits`` where given): the converter
    keeps it in mtp.safetensors, a file mlx-lm does not read."""

    weights: Dict[str, mx.array] = {}
    for file in sorted(path.glob("model*.safetensors")) or sorted(path.glob("*.safetensors")):
        weights.update(mx.load(str(file)))
    layers = text_config(config).get("num_hidden_layers", 0)
    found = {k: v for k, v in weights.items() if is_mtp(k, config["model_type"], layers)}
    if not found:
        return {}
    model_class, args_class = model_classes(config["model_type"])
    model = model_class(args_class.from_dict(config))
    tensors = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
               for k, v in sanitize_mtp(found, model, raw=is_raw(weights)).items()}
    if bits:  # (quantized for the text model, whose layers the module's is one of)
        record = ARCHITECTURES[config["model_type"]]
        tensors = quantized(getattr(model, record.text_model) if record.text_model else model, tensors, group_size,
                            bits)
    return tensors


def source_dtype(config: Dict[str, Any], tensors: List[SourceTensor]) -> mx.Dtype:
    named = config.get("torch_dtype") or config.get("dtype")
    if named in _TORCH_DTYPES:
        return _TORCH_DTYPES[named]
    return next((t.load().dtype for t in tensors if len(t.shape) == 2), mx.float16)


def copy_tokenizer(path: Path, out: Path) -> None:
    for name in TOKENIZER_FILES:
        if (path / name).exists():
            shutil.copy(path / name, out / name)


def output_config(config: Dict[str, Any], dtype: Optional[mx.Dtype]) -> Dict[str, Any]:
    config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    if dtype is not None:
        config["torch_dtype"] = str(dtype).split(".")[-1]
    return config
