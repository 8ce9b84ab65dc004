"""What a model's or a drafter's directory says of itself, read once and checked before
anything is allocated: its config.json as an object, what its weight files hold, and the
sizes its config asks for against them."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from .errors import UserError
from .files import read_json


def read_config(directory: Path, what: str) -> dict:
    """``directory``/config.json as a JSON object, or one line: no such file (it is not
    ``what``), not JSON, or not an object."""
    file = Path(directory) / "config.json"
    if not Path(directory).is_dir():
        raise UserError(f"{directory} is not a directory; pass {what}")
    if not file.exists():
        raise UserError(f"{directory} has no config.json; is it {what}?")
    try:
        config = read_json(file)
    except ValueError as exc:
        raise UserError(f"{file} cannot be read as a config: {exc}") from None
    if not isinstance(config, dict):
        raise UserError(f"{file} holds a JSON {type(config).__name__}, not an object")
    return config


def safetensors_bytes(directory: Path) -> int:
    """What a model directory's .safetensors files hold, in bytes, or one line when it has
    none (a PyTorch .bin alone is not read for models: unpickling can run code)."""
    files = list(Path(directory).glob("*.safetensors"))
    if not files:
        has_bin = any(Path(directory).glob("*.bin"))
        raise UserError(f"{directory} has no .safetensors weights" + (
            " (its PyTorch .bin checkpoint is not read, for safety: save it as safetensors with transformers' "
            "save_pretrained(safe_serialization=True))" if has_bin else "; copy them from the model's repository"))
    return sum(f.stat().st_size for f in files)


ARCHITECTURE_LIMITS = {"hidden_size": 1 << 16, "num_hidden_layers": 1024, "intermediate_size": 1 << 18,
                       "num_attention_heads": 1024, "vocab_size": 1 << 21}
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope", "su")
# The fewest bytes a weight can take (2-bit quantization, before its scales).
MIN_BYTES_PER_PARAMETER = 0.25


def _whole(config: dict, name: str, limit: int, source) -> int:
    value = config.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise UserError(f"{source}: {name} is {value!r}; a model's config.json gives a whole number from 1 to {limit}")
    return value


def parameter_count(config: dict) -> int:
    """About how many weights a (checked) llama-style config describes."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    return layers * (attention + 3 * hidden * config["intermediate_size"]) + config["vocab_size"] * hidden


def check_model_config(config: dict, source, weight_bytes: Optional[int] = None, llama_shaped: bool = True) -> None:
    """One line for a config.json whose architecture cannot be meant: sizes that are not
    positive whole numbers in range, heads that do not divide, an unknown RoPE scaling,
    or (given ``weight_bytes``, what the weight files hold) more weights than the files
    could possibly carry. Checked before anything is allocated. A config that is not
    ``llama_shaped`` (a recurrent family's) has only the sizes it gives checked."""
    if not llama_shaped:
        for name, limit in ARCHITECTURE_LIMITS.items():
            if name in config:
                _whole(config, name, limit, source)
        return
    for name, limit in ARCHITECTURE_LIMITS.items():
        _whole(config, name, limit, source)
    heads = config["num_attention_heads"]
    kv_heads = _whole(config, "num_key_value_heads", heads, source) if "num_key_value_heads" in config and \
        config["num_key_value_heads"] is not None else heads
    if heads % kv_heads:
        raise UserError(f"{source}: {heads} attention heads cannot share {kv_heads} key/value heads evenly")
    if config.get("head_dim") is not None:
        _whole(config, "head_dim", 4096, source)
    elif config["hidden_size"] % heads:
        raise UserError(f"{source}: hidden_size {config['hidden_size']} is not a multiple of {heads} heads")
    for name in ("rms_norm_eps", "rope_theta"):
        value = config.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise UserError(f"{source}: {name} is {value!r}; expected a positive number")
    scaling = config.get("rope_scaling")
    if scaling is not None:
        kind = scaling.get("type") or scaling.get("rope_type", "default") if isinstance(scaling, dict) else None
        if kind not in ROPE_TYPES:
            raise UserError(f"{source}: rope_scaling {scaling!r} is not one this runtime knows "
                            f"({', '.join(ROPE_TYPES)})")
    if weight_bytes is not None:
        parameters = parameter_count(config)
        if parameters * MIN_BYTES_PER_PARAMETER > weight_bytes:
            raise UserError(f"{source}: config.json describes {parameters / 1e9:.3g}B weights, but the weight files "
                            f"hold only {weight_bytes / 1e6:.3g} MB; the config or the weights are damaged")
