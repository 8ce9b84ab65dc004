"""Convert a target model (GGUF file or Hugging Face directory) into an mlx-lm model directory.

    python -m mlx_eagle.convert SRC OUT [--q-bits 4 --q-group-size 32 | --dtype float32]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx

from ..cli import run_cli
from ..errors import UserError

from .writer import OutputFormat, write_model_dir

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def convert_target(
    src: Path,
    out: Path,
    q_bits: Optional[int] = None,
    q_group_size: Optional[int] = None,
    dtype: Optional[str] = None,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Convert ``src`` into an mlx-lm directory at ``out`` and return its path.

    With neither ``q_bits`` nor ``dtype`` the source keeps its own format: float
    stays float, GGUF quantization that MLX holds exactly (Q4_0, Q4_1, Q5_0,
    Q5_1, Q8_0) is kept bit for bit, K-quants are re-quantized.
    """
    src = Path(src)
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    if not src.exists():
        raise UserError(f"{src} does not exist; pass a .gguf file or a Hugging Face model directory")
    is_gguf = src.is_file()
    # GGUF blocks hold 32 values: the same group keeps their quantization exact.
    fmt = OutputFormat(
        dtype=DTYPES.get(dtype),
        bits=q_bits,
        group_size=q_group_size or (32 if is_gguf else 64),
    )
    if is_gguf:
        from . import gguf_weights
        from .gguf_tokenizer import build_tokenizer

        reader = gguf_weights.open_gguf(src)
        config = gguf_weights.read_config(reader, src)
        tokenizer = build_tokenizer(reader, src, config["max_position_embeddings"])
        tensors = gguf_weights.read_tensors(reader, config, src)
        float_dtype = fmt.dtype or gguf_weights.source_dtype(reader) or mx.float16
        save_tokenizer = tokenizer.save_pretrained
    else:
        from . import hf_weights

        config = hf_weights.read_config(src)
        tensors = hf_weights.read_tensors(src, config)
        float_dtype = fmt.dtype or hf_weights.source_dtype(config, tensors)
        config = hf_weights.output_config(config, float_dtype)

        def save_tokenizer(staging: Path) -> None:
            hf_weights.copy_tokenizer(src, staging)

    return write_model_dir(out, config, tensors, save_tokenizer, fmt, float_dtype, overwrite, progress)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m mlx_eagle.convert",
        description="Convert a GGUF file or a Hugging Face model directory into an mlx-lm model directory.",
    )
    parser.add_argument("src", type=Path, help="a .gguf file or a Hugging Face model directory")
    parser.add_argument("out", type=Path, help="the MLX model directory to write")
    parser.add_argument("--q-bits", type=int, choices=[2, 3, 4, 5, 6, 8], help="quantize weights to this many bits")
    parser.add_argument("--q-group-size", type=int, choices=[32, 64, 128],
                        help="values per quantization group (default 32 from GGUF, 64 otherwise)")
    parser.add_argument("--dtype", choices=list(DTYPES),
                        help="float type of the weights (with --q-bits: of the scales and norms)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.q_group_size and not args.q_bits:
        parser.error("--q-group-size needs --q-bits")
    out = convert_target(args.src, args.out, args.q_bits, args.q_group_size, args.dtype,
                         args.overwrite, progress=not args.quiet)
    print(f"wrote {out}")


def cli() -> None:
    """Console-script entry point."""
    run_cli(main)


if __name__ == "__main__":
    cli()
