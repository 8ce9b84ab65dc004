"""Convert a published EAGLE head (EAGLE-1/2 or EAGLE-3), or a DFlash or DSpark block drafter, into an
MLX drafter directory.

    python -m mlx_eagle.convert.head SRC OUT --target TARGET [--q-bits 8|4 [--q-group-size 64]] [--dtype float16]

SRC is a checkpoint directory as published (config.json with model.safetensors, sharded
safetensors with an index, or pytorch_model.bin) or a Hugging Face repo id, written by
any of the tools that publish heads: the official EAGLE code, SpecForge and AngelSlim
(the official layout), vLLM's speculators (a nested config, ``layers.0``, optional
norm-before-residual and input norm) or NVIDIA's Model Optimizer (``layers.0``, flags in
``eagle_config``, possibly the whole vocabulary and no d2t). Each is first brought to the
official layout (``published_layout``); fused q/k/v and gate/up projections are split.
The family comes from the tensors; the head is checked against TARGET (any --model
value) and the output is written atomically, then loaded once to prove it works. A DFlash
checkpoint (a config.json with dflash_config) is checked, cast and quantized the same way
and written in its own (z-lab) layout, and a DSpark checkpoint (DeepSpec's: markov_rank
and the block's fields in its config.json) in DeepSpec's, without its copies of the
target's embedding and LM head, which the target's own stand for.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Callable, Dict, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..architectures import target_identity
from ..cli import new_parser, run_cli
from ..configs import read_config
from ..errors import UserError
from ..files import read_json, replace_directory
from ..hub import from_hub
from ..progress import progress_bar
from .target import DTYPES
from .torch_pickle import load_torch_bin

if TYPE_CHECKING:  # the command's module: what loads mlx-lm is imported where it is used, so --help answers at once
    from ..heads import HeadConfig

_HUB_FILES = ("*.json", "*.safetensors", "*.bin")


def _locate(src: str) -> Path:
    path = Path(src).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise UserError(f"{path} is a file; pass the head's directory (config.json and weights)")
    if src.count("/") == 1 and not src.startswith((".", "/", "~")):
        return from_hub(src, _HUB_FILES, "pass a local head directory")
    raise UserError(f"{src} does not exist; pass an EAGLE head directory or a Hugging Face repo id")


MAX_INDEX_BYTES = 16 << 20  # a shard index names every tensor: megabytes for the largest models


def _weight_files(path: Path) -> Sequence[Path]:
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (path / index).exists():
            try:
                weight_map = read_json(path / index, MAX_INDEX_BYTES)["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise UserError(f"{path / index} is not a valid shard index ({exc})") from None
            files = [path / name for name in sorted(set(weight_map.values()))]
            missing = [f.name for f in files if not f.exists()]
            if missing:
                raise UserError(f"{path}: shard {missing[0]} named in {index} is missing; download it too")
            return files
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
    if not files:
        raise UserError(f"{path} has no weights (model.safetensors or pytorch_model.bin)")
    return files


def read_checkpoint(path: Path) -> Tuple[dict, Dict[str, mx.array]]:
    """config.json and every tensor, read without running pickled code."""
    config = read_config(path, "an EAGLE head checkpoint")
    tensors: Dict[str, mx.array] = {}
    for file in progress_bar(_weight_files(path), desc="reading head", unit="file", leave=False):
        if file.suffix == ".bin":
            tensors.update({k: mx.array(v) for k, v in load_torch_bin(file).items()})
            continue
        try:
            tensors.update(mx.load(str(file)))
        except Exception as exc:
            raise UserError(f"{file} is damaged or truncated ({exc}); download it again") from None
    return config, tensors


def detect_family(tensors: Dict[str, mx.array]) -> str:
    """EAGLE-3 has its own norm, LM head and d2t; EAGLE-1/2 use the target's."""
    if "fc.weight" not in tensors:
        if "fusion_fc.weight" in tensors:
            raise UserError("a speculators EAGLE head whose config.json lacks speculators_model_type; "
                            "download its config.json too")
        raise UserError("not an EAGLE head: no fc.weight (found " + ", ".join(sorted(tensors)[:4]) + ", ...)")
    if any(k.startswith("midlayer.") for k in tensors) or "lm_head.weight" in tensors or "d2t" in tensors:
        return "eagle3"
    return "eagle1"


def _renamed(tensors: Dict[str, mx.array], renames: Sequence[Tuple[str, str]]) -> Dict[str, mx.array]:
    """``tensors`` with each name's prefix ``old`` replaced by ``new`` (first match)."""
    return {next((new + k[len(old):] for old, new in renames if k.startswith(old)), k): v for k, v in tensors.items()}


_LAYER_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "rms_norm_eps", "max_position_embeddings", "vocab_size", "num_hidden_layers")


def _from_speculators(raw: dict, tensors: Dict[str, mx.array], source: str) -> Tuple[dict, Dict[str, mx.array]]:
    """vLLM speculators: the layer's config nested (written as its difference from the
    transformers defaults), EAGLE-3 under ``layers.0``, EAGLE-1 as ``fusion_fc`` and
    ``transformer``; the verifier's norm and LM head, kept for training, are dropped."""
    kind = raw["speculators_model_type"]
    if kind not in ("eagle", "eagle3"):
        raise UserError(f"{source}: speculators_model_type {kind!r} is not an EAGLE head; supported are eagle, eagle3")
    layer = raw.get("transformer_layer_config") or {}
    if not isinstance(layer, dict):
        raise UserError(f"{source}: transformer_layer_config is not a JSON object")
    from transformers import AutoConfig

    try:
        full = AutoConfig.for_model(layer.get("model_type", "llama"),
                                    **{k: v for k, v in layer.items() if k != "model_type"}).to_dict()
    except (ValueError, TypeError, KeyError) as exc:
        raise UserError(f"{source}: transformer_layer_config is not a config transformers knows ({exc})") from None
    flat = {k: full.get(k) for k in _LAYER_KEYS}
    rope = full.get("rope_parameters") or {}
    flat["rope_theta"] = rope.get("rope_theta", full.get("rope_theta"))
    if rope.get("rope_type", "default") != "default":
        flat["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if kind == "eagle":  # speculators' name for EAGLE-1/2
        if raw.get("layernorms"):
            raise UserError(f"{source}: a speculators EAGLE head with layernorms true (extra embedding and "
                            "pre-LM-head norms) is not supported; only layernorms false")
        tensors = _renamed(tensors, (("fusion_fc.", "fc."), ("transformer.", "layers.0.")))
        flat["family"] = "eagle1"
    else:
        flat.update(draft_vocab_size=raw.get("draft_vocab_size"), target_hidden_size=raw.get("target_hidden_size"),
                    norm_before_residual=bool(raw.get("norm_before_residual")),
                    norm_before_fc=bool(raw.get("norm_before_fc")), family="eagle3")
        if raw.get("eagle_aux_hidden_state_layer_ids"):
            flat["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": raw["eagle_aux_hidden_state_layer_ids"]}
    return flat, {k: v for k, v in tensors.items() if not k.startswith("verifier")}


# Model Optimizer's eagle_config flags, and the only value of each this runtime computes.
_MODELOPT_FLAGS = {"use_aux_hidden_state": True, "use_input_layernorm_in_first_layer": True,
                   "use_last_layernorm": True, "use_mtp_layernorm": False}


def _check_modelopt(raw: dict, source: str) -> None:
    """NVIDIA Model Optimizer: refuse, naming it, any setting the official computation lacks."""
    eagle = raw["eagle_config"]
    for flag, supported in _MODELOPT_FLAGS.items():
        if eagle.get(flag) is not None and bool(eagle[flag]) != supported:
            raise UserError(f"{source}: eagle_config.{flag} is {eagle[flag]!r}; only {supported} is supported")
    if (eagle.get("parallel_draft_step") or 1) > 1:
        raise UserError(f"{source}: eagle_config.parallel_draft_step is {eagle['parallel_draft_step']} "
                        "(parallel drafting heads); only 1 is supported")


def _split_fused(raw: dict, tensors: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """Fused q/k/v and gate/up projections, as some exporters write them, split into the
    separate projections (q, k, v rows in that order; gate rows before up rows)."""
    heads = raw.get("num_attention_heads") or 1
    kv_heads = raw.get("num_key_value_heads") or heads
    head_dim = raw.get("head_dim") or (raw.get("hidden_size") or 0) // heads
    result = {}
    for name, value in tensors.items():
        if ".qkv_proj." in name:
            rows = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
            if value.shape[0] != sum(rows):
                raise UserError(f"{name} has {value.shape[0]} rows, not the {sum(rows)} its config implies")
            for part, piece in zip("qkv", mx.split(value, [rows[0], rows[0] + rows[1]], axis=0)):
                result[name.replace(".qkv_proj.", f".{part}_proj.")] = piece
        elif ".gate_up_proj." in name:
            gate, up = mx.split(value, 2, axis=0)
            result[name.replace(".gate_up_proj.", ".gate_proj.")] = gate
            result[name.replace(".gate_up_proj.", ".up_proj.")] = up
        else:
            result[name] = value
    return result


def published_layout(raw: dict, tensors: Dict[str, mx.array], source: str) -> Tuple[dict, Dict[str, mx.array]]:
    """A head's config (flat, Llama-style) and tensors in the official EAGLE layout,
    whichever tool wrote it; one line for a setting or format this runtime lacks."""
    if "speculators_model_type" in raw:
        raw, tensors = _from_speculators(raw, tensors, source)
    elif isinstance(raw.get("eagle_config"), dict) and "use_aux_hidden_state" in raw["eagle_config"]:
        _check_modelopt(raw, source)
    if raw.get("quantization_config"):
        method = (raw["quantization_config"] or {}).get("quant_method", "quantized")
        raise UserError(f"{source}: the head is quantized ({method}); convert an unquantized export "
                        "(--q-bits quantizes it here)")
    if (raw.get("num_hidden_layers") or 1) > 1:
        raise UserError(f"{source}: the head has {raw['num_hidden_layers']} decoder layers (num_hidden_layers); "
                        "only one-layer EAGLE heads are supported")
    return raw, _split_fused(raw, tensors)


def head_config(raw: dict, family: str, tensors: Dict[str, mx.array], target: nn.Module,
                official_code: bool = False) -> HeadConfig:
    """``official_code``: the checkpoint is in the official code's own layout (``midlayer``)."""
    from ..heads import HEADS, HeadConfig

    kind, args = HEADS[family], target.args
    hidden = raw.get("hidden_size")
    if hidden is None:
        raise UserError("the head's config.json has no hidden_size")
    layer = kind.layer_prefix
    rope_scaling = raw.get("rope_scaling")
    if official_code and (rope_scaling or {}).get("rope_type") == "llama3":
        rope_scaling = None  # the official EAGLE code and SpecForge run such heads on plain RoPE
    config = HeadConfig(
        family=family, hidden_size=hidden, intermediate_size=raw.get("intermediate_size") or 0,
        num_attention_heads=raw.get("num_attention_heads") or 0,
        num_key_value_heads=raw.get("num_key_value_heads") or raw.get("num_attention_heads") or 0,
        vocab_size=raw.get("vocab_size") or args.vocab_size, head_dim=raw.get("head_dim"),
        rms_norm_eps=raw.get("rms_norm_eps") or 1e-6,
        rope_theta=raw.get("rope_theta") or 10000.0,  # the official code's default when absent
        rope_scaling=rope_scaling, max_position_embeddings=raw.get("max_position_embeddings") or 8192,
        bias="fc.bias" in tensors, attention_bias=f"{layer}.self_attn.q_proj.bias" in tensors,
        norm_before_residual=bool(raw.get("norm_before_residual")),
        norm_before_fc="input_norm.weight" in tensors,
    )
    if kind.draft_vocabulary:
        config.draft_vocab_size = int(tensors["lm_head.weight"].shape[0]) if "lm_head.weight" in tensors else None
        config.target_hidden_size = raw.get("target_hidden_size") or int(tensors["fc.weight"].shape[1]) // 3
        taps = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        config.taps = [int(t) for t in taps] if taps else None
    return config


def normalise(family: str, tensors: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """Our key layout (the official one): some EAGLE-3 exporters call midlayer layers.0."""
    from ..heads import HEADS

    return _renamed(tensors, [("layers.0.", HEADS[family].layer_prefix + ".")])


def _embedding_matches(own: mx.array, target: nn.Module) -> bool:
    layer = target.model.embed_tokens
    theirs = layer(mx.arange(layer.weight.shape[0])) if "scales" in layer else layer.weight
    if theirs.shape != own.shape:
        return False
    tolerance = 1e-2 * float(mx.abs(own).max().item()) if "scales" in layer else 1e-3
    return bool(mx.allclose(own.astype(mx.float32), theirs.astype(mx.float32), atol=tolerance).item())


def build_head(raw: dict, tensors: Dict[str, mx.array], target: nn.Module, source: str) -> nn.Module:
    """The head as an MLX module holding the checkpoint's tensors, checked against ``target``."""
    from ..heads import HEADS, check_draft_vocabulary, check_fits

    raw, tensors = published_layout(raw, tensors, source)
    family = raw.get("family") or detect_family(tensors)
    official_code = any(k.startswith("midlayer.") for k in tensors)
    tensors = normalise(family, tensors)
    config = head_config(raw, family, tensors, target, official_code)
    kind = HEADS[family]
    if kind.draft_vocabulary and "d2t" not in tensors:
        if config.draft_vocab_size not in (None, config.vocab_size):
            raise UserError(f"{source}: no d2t for its draft vocabulary of {config.draft_vocab_size}; "
                            "download the whole checkpoint")
        # Model Optimizer: a head over the whole vocabulary comes without a map.
        tensors["d2t"] = mx.zeros((config.vocab_size,), dtype=mx.int64)
    head = kind(config)
    t2d = tensors.pop("t2d", None)  # implied by d2t
    own = tensors.pop("embed_tokens.weight", None)
    if own is not None and not _embedding_matches(own, target):
        head.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        tensors["embed_tokens.weight"] = own
    check_fits(head, target, source)
    expected = dict(tree_flatten(head.parameters()))
    unknown = sorted(set(tensors) - set(expected))
    missing = sorted(set(expected) - set(tensors))
    if unknown or missing:
        raise UserError(f"{source}: not a {family} head in the official layout: "
                        + (f"unexpected {', '.join(unknown[:3])}" if unknown else "")
                        + ("; " if unknown and missing else "")
                        + (f"missing {', '.join(missing[:3])}" if missing else ""))
    for name, value in tensors.items():
        if tuple(value.shape) != tuple(expected[name].shape):
            raise UserError(f"{source}: {name} has shape {tuple(value.shape)}, its config.json implies "
                            f"{tuple(expected[name].shape)}")
    if kind.draft_vocabulary:
        tensors["d2t"] = tensors["d2t"].astype(mx.int64)
        check_draft_vocabulary(tensors["d2t"], target.args.vocab_size, source, t2d)
    head.load_weights(list(tensors.items()), strict=True)
    return head


def convert_head(src: str, out: Path, target: Optional[str] = None, q_bits: Optional[int] = None,
                 q_group_size: int = 64, dtype: Optional[str] = None, overwrite: bool = False) -> Path:
    from .. import dflash_model, dspark_model
    from ..heads import TARGET_FILE, load_head, save_head
    from ..models import load_target

    path = _locate(src)  # a wrong SRC fails before the target is loaded
    raw, tensors = read_checkpoint(path)
    model, _, _ = load_target(target)
    for blocks, save in ((dspark_model, dspark_model.save_dspark), (dflash_model, dflash_model.save_dflash)):
        if blocks.recognizes(path, raw):
            return _convert_blocks(blocks, save, raw, tensors, path, out, model, q_bits, q_group_size, dtype,
                                   overwrite)
    head = build_head(raw, tensors, model, str(path))
    if q_bits:
        nn.quantize(head, group_size=q_group_size, bits=q_bits,
                    class_predicate=lambda p, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % q_group_size == 0)
        head.config.extra["quantization"] = {"group_size": q_group_size, "bits": q_bits}

    def fill(staging: Path) -> None:
        save_head(head, staging, dtype=DTYPES[dtype] if dtype else None)
        # Whom it drafts for, so that shipped in mlx_eagle/weights/ it is found by --draft auto.
        (staging / TARGET_FILE).write_text(json.dumps(target_identity(model), indent=1) + "\n")
        load_head(staging, model)  # what was written loads and fits

    return replace_directory(out, fill, overwrite)


def _convert_blocks(blocks: ModuleType, save: Callable, raw: dict, tensors: Dict[str, mx.array], path: Path,
                    out: Path, model: nn.Module, q_bits: Optional[int], q_group_size: int, dtype: Optional[str],
                    overwrite: bool) -> Path:
    """A block drafter's checkpoint (``blocks``: dflash_model or dspark_model), checked
    against the target, cast and optionally quantized, written by ``save`` in its
    published layout."""
    drafter = blocks.build(raw, tensors, model, path / "config.json")
    drafter.set_dtype(DTYPES[dtype] if dtype else mx.float32)
    if q_bits:
        nn.quantize(drafter, group_size=q_group_size, bits=q_bits,
                    class_predicate=lambda p, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % q_group_size == 0)
        drafter.config.extra["quantization"] = {"group_size": q_group_size, "bits": q_bits}

    def fill(staging: Path) -> None:
        save(drafter, staging, dtype=DTYPES[dtype] if dtype else None)
        blocks.load(staging, model)  # what was written loads and fits

    return replace_directory(out, fill, overwrite)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = new_parser("mlx_eagle.convert.head", __doc__)
    parser.add_argument("src", help="head checkpoint directory or Hugging Face repo id")
    parser.add_argument("out", type=Path, help="the MLX head directory to write")
    parser.add_argument("--target", help="the target it drafts for, as --model takes it (default: SmolLM2)")
    parser.add_argument("--q-bits", type=int, choices=[4, 8], help="quantize the head's linear layers")
    parser.add_argument("--q-group-size", type=int, choices=[32, 64, 128], default=64,
                        help="values per quantization group, with --q-bits")
    parser.add_argument("--dtype", choices=list(DTYPES), help="float type of the weights (default: as published)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    args = parser.parse_args(argv)
    out = convert_head(args.src, args.out, args.target, args.q_bits, args.q_group_size, args.dtype, args.overwrite)
    print(f"wrote {out}")


def cli() -> None:
    """Console-script entry point."""
    run_cli(main)


if __name__ == "__main__":
    cli()
