"""Export an MLX head directory to the official EAGLE layout, for SGLang, vLLM and the
official EAGLE code.

    python -m mlx_eagle.convert.export HEAD OUT [--dtype bfloat16]

EAGLE-3: model.safetensors with fc, midlayer.*, norm, lm_head, d2t (int64) and t2d (bool),
and a Llama-style config.json (``LlamaForCausalLMEagle3``, draft_vocab_size,
target_hidden_size, and the tapped layers as eagle_config.eagle_aux_hidden_state_layer_ids).
EAGLE-1/2: fc, layers.0.* and a Llama config with num_hidden_layers 1 and bias.
Quantized heads are dequantized: the official formats hold plain floats.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional, Sequence

import mlx.core as mx

from ..cli import new_parser, run_cli
from ..files import replace_directory
from .target import DTYPES


def dequantized(weights: Dict[str, mx.array], config: dict) -> Dict[str, mx.array]:
    quantization = config.get("quantization")
    if not quantization:
        return dict(weights)
    result = {}
    for name, value in weights.items():
        if name.endswith((".scales", ".biases")) and name.rsplit(".", 1)[0] + ".weight" in weights:
            continue
        prefix = name[: -len(".weight")] if name.endswith(".weight") else None
        if prefix is not None and f"{prefix}.scales" in weights:
            value = mx.dequantize(value, weights[f"{prefix}.scales"], weights.get(f"{prefix}.biases"),
                                  quantization["group_size"], quantization["bits"])
        result[name] = value
    return result


def official_config(config: dict, dtype: mx.Dtype) -> dict:
    from ..heads import HEADS

    kind = HEADS[config["family"]]
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings", "vocab_size")
    result = {k: config[k] for k in keep if config.get(k) is not None}
    result.update(model_type="llama", num_hidden_layers=1, tie_word_embeddings=False,
                  torch_dtype=str(dtype).split(".")[-1], bias=bool(config.get("bias")),
                  architectures=[kind.official_architecture])
    if kind.draft_vocabulary:
        result.update(draft_vocab_size=config["draft_vocab_size"],
                      target_hidden_size=config.get("target_hidden_size") or config["hidden_size"])
        if config.get("taps"):
            result["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(config["taps"])}
        for flag in ("norm_before_residual", "norm_before_fc"):  # speculators' names, which vLLM reads
            if config.get(flag):
                result[flag] = True
    return result


def export_head(head: Path, out: Path, dtype: Optional[str] = None, overwrite: bool = False) -> Path:
    from ..heads import HEADS, read_head_weights

    config, weights = read_head_weights(Path(head))
    weights = dequantized(weights, config)
    floats = [v.dtype for v in weights.values() if mx.issubdtype(v.dtype, mx.floating)]
    target_dtype = DTYPES[dtype] if dtype else floats[0]
    weights = {k: v.astype(target_dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    if HEADS[config["family"]].draft_vocabulary:
        d2t = weights["d2t"].astype(mx.int64)
        used = mx.arange(d2t.shape[0]) + d2t
        t2d = mx.zeros((config["vocab_size"],), dtype=mx.bool_)
        t2d[used] = True
        weights.update(d2t=d2t, t2d=t2d)

    def fill(staging: Path) -> None:
        mx.save_safetensors(str(staging / "model.safetensors"), weights, metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(official_config(config, target_dtype), indent=2))

    return replace_directory(out, fill, overwrite)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = new_parser("mlx_eagle.convert.export", __doc__)
    parser.add_argument("head", type=Path, help="an MLX head directory (ours, or converted)")
    parser.add_argument("out", type=Path, help="the directory to write in the official layout")
    parser.add_argument("--dtype", choices=list(DTYPES), help="float type (default: the head's)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    args = parser.parse_args(argv)
    print(f"wrote {export_head(args.head, args.out, args.dtype, args.overwrite)}")


def cli() -> None:
    """Console-script entry point."""
    run_cli(main)


if __name__ == "__main__":
    cli()
