"""Write an mlx-lm model directory, atomically: all of it, or nothing."""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Union

import mlx.core as mx
from mlx_lm.utils import load_model, load_tokenizer

from ..architectures import ARCHITECTURES, model_classes
from ..errors import UserError
from ..files import replace_directory
from ..progress import progress_bar
from .tensors import QuantizedWeight, SourceTensor

_SHARD_BYTES = 2 << 30


@dataclass
class OutputFormat:
    """What the user asked for: float weights of ``dtype``, or ``bits``-bit quantized
    weights (scales in ``dtype``). Neither keeps the source's own format."""

    dtype: Optional[mx.Dtype] = None
    bits: Optional[int] = None
    group_size: int = 32


def _quantize(value: mx.array, bits: int, group_size: int, dtype: mx.Dtype) -> QuantizedWeight:
    weight, scales, biases = mx.quantize(value.astype(dtype), group_size=group_size, bits=bits)
    return QuantizedWeight(weight, scales, biases, bits, group_size)


def quantizable_layers(config: Dict[str, Any]) -> Optional[Dict[str, Union[bool, dict]]]:
    """Per module path of a model of ``config``, what mlx-lm's own quantization does to it:
    False (kept float: no quantized form, such as DeepSeek's expert router, or the model's
    ``quant_predicate`` says so), True, or that predicate's own {bits, group_size}. None:
    not an architecture this runtime builds (every matrix is then taken for a layer)."""

    if config.get("model_type") not in ARCHITECTURES:
        return None
    model_class, args_class = model_classes(config["model_type"])
    model = model_class(args_class.from_dict(config))  # (its random weights are never computed)
    predicate = getattr(model, "quant_predicate", None) or (lambda path, module: True)
    return {path: hasattr(module, "to_quantized") and predicate(path, module)
            for path, module in model.named_modules()}


def convert_tensor(tensor: SourceTensor, fmt: OutputFormat, float_dtype: mx.Dtype,
                   layer: Union[bool, dict] = True):
    """The output for one tensor: a float array or a QuantizedWeight. ``layer``: what
    quantizable_layers says of the module holding it."""
    # Matrices, and the stacked matrices of a mixture of experts (mlx-lm's SwitchLinear).
    is_matrix = tensor.name.endswith(".weight") and len(tensor.shape) in (2, 3)
    if not is_matrix or layer is False or (fmt.dtype is not None and fmt.bits is None):
        return tensor.load().astype(float_dtype)
    bits, group_size = fmt.bits, fmt.group_size
    if isinstance(layer, dict) and bits is not None:  # the model's own choice for this layer (a router at 8 bits)
        bits, group_size = layer.get("bits", bits), layer.get("group_size", group_size)
    if bits is None:  # keep the source's format
        bits, group_size = tensor.native_bits or tensor.requantize_bits, 32
        if bits is None:
            return tensor.load().astype(float_dtype)
    if tensor.shape[-1] % group_size:
        return tensor.load().astype(float_dtype)
    # float16 scales widen to float32 exactly; to bfloat16 they would round.
    exact = tensor.load_native is not None and (tensor.native_bits, 32) == (bits, group_size)
    if exact and float_dtype in (mx.float16, mx.float32):
        native = tensor.load_native()
        if native is not None:
            native.scales, native.biases = native.scales.astype(float_dtype), native.biases.astype(float_dtype)
            return native
    return _quantize(tensor.load(), bits, group_size, float_dtype)


def _module_path(name: str) -> str:
    return name.rsplit(".", 1)[0]


def write_model_dir(
    out: Path,
    config: Dict[str, Any],
    tensors: List[SourceTensor],
    save_tokenizer: Callable[[Path], None],
    fmt: OutputFormat,
    float_dtype: mx.Dtype,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Convert ``tensors`` into an mlx-lm directory at ``out``, checked by loading it with
    mlx-lm before it is renamed into place."""

    def fill(staging: Path) -> None:
        _write(staging, config, tensors, save_tokenizer, fmt, float_dtype, progress)
        _check_loads(staging)

    return replace_directory(out, fill, overwrite)


def _write(staging, config, tensors, save_tokenizer, fmt, float_dtype, progress) -> None:
    shard: Dict[str, mx.array] = {}
    shard_keys: List[List[str]] = []
    shard_bytes = 0
    quantized: Dict[str, Dict[str, int]] = {}
    layers = quantizable_layers(config) if tensors else None
    for tensor in progress_bar(tensors, desc="converting", unit="tensor", disable=not progress, leave=False):
        layer = True if layers is None else layers.get(_module_path(tensor.name), False)
        value = convert_tensor(tensor, fmt, float_dtype, layer)
        if isinstance(value, QuantizedWeight):
            path = _module_path(tensor.name)
            quantized[path] = {"group_size": value.group_size, "bits": value.bits}
            arrays = {f"{path}.weight": value.weight, f"{path}.scales": value.scales, f"{path}.biases": value.biases}
        else:
            arrays = {tensor.name: value}
        mx.eval(list(arrays.values()))
        size = sum(a.nbytes for a in arrays.values())
        if shard_bytes and shard_bytes + size > _SHARD_BYTES:
            shard_keys.append(_save_shard(staging, len(shard_keys) + 1, shard))
            shard_bytes = 0
        shard.update(arrays)
        shard_bytes += size
    shard_keys.append(_save_shard(staging, len(shard_keys) + 1, shard))
    _name_shards(staging, shard_keys)

    config = dict(config)
    if quantized:
        common = Counter(tuple(sorted(q.items())) for q in quantized.values()).most_common(1)[0][0]
        default = dict(common)
        config["quantization"] = {
            **default,
            "mode": "affine",
            **{path: q for path, q in quantized.items() if q != default},
        }
        config["quantization_config"] = config["quantization"]
    config["torch_dtype"] = str(float_dtype).split(".")[-1]
    (staging / "config.json").write_text(json.dumps(dict(sorted(config.items())), indent=2))
    save_tokenizer(staging)


def _save_shard(staging: Path, number: int, arrays: Dict[str, mx.array]) -> List[str]:
    mx.save_safetensors(str(staging / f"shard-{number}.safetensors"), arrays, metadata={"format": "mlx"})
    keys = list(arrays)
    arrays.clear()
    return keys


def _name_shards(staging: Path, shard_keys: List[List[str]]) -> None:
    """Give the shards mlx-lm's names, which need the count known only at the end."""
    count = len(shard_keys)
    weight_map = {}
    for number, keys in enumerate(shard_keys, start=1):
        name = "model.safetensors" if count == 1 else f"model-{number:05d}-of-{count:05d}.safetensors"
        os.replace(staging / f"shard-{number}.safetensors", staging / name)
        weight_map.update((key, name) for key in keys)
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _check_loads(staging: Path) -> None:

    try:
        load_model(staging, lazy=True)
        load_tokenizer(staging)
    except Exception as exc:
        raise UserError(f"the converted model does not load in mlx-lm ({exc})") from exc
