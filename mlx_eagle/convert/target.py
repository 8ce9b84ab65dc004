"""Convert a target model (GGUF file or Hugging Face directory) into an mlx-lm model directory.

    python -m mlx_eagle.convert SRC OUT [--q-bits 4 --q-group-size 32 | --dtype float32]
"""

from __future__ import annotations

import functools
import hashlib
import sys
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx

from ..cli import new_parser, run_cli
from ..errors import UserError
from . import gguf_weights

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
# The code that decides what a conversion writes. The cache keys converted models by its
# digest (converter_version), so that changed converter code converts again, and unchanged
# code (a new clone, a reinstall) never does.
_CONVERTER_FILES = ("target.py", "writer.py", "gguf_weights.py", "gguf_tokenizer.py", "hf_weights.py", "tensors.py",
                    "../architectures.py")


@functools.lru_cache(maxsize=None)
def converter_version() -> str:
    """The first 8 hex digits of the converter's code's sha256."""
    code = hashlib.sha256()
    for name in _CONVERTER_FILES:
        code.update((Path(__file__).parent / name).read_bytes())
    return code.hexdigest()[:8]


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
    # Imported here, not above: they load mlx-lm and transformers, and --help answers at once.
    from .writer import OutputFormat, write_model_dir

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
        from .gguf_tokenizer import build_tokenizer

        reader = gguf_weights.open_gguf(src)
        config = gguf_weights.gguf_config(reader, src)
        tokenizer = build_tokenizer(reader, src, config["max_position_embeddings"])
        tensors = gguf_weights.read_tensors(reader, config, src)
        float_dtype = fmt.dtype or gguf_weights.source_dtype(reader) or mx.float16
        save_tokenizer = tokenizer.save_pretrained
    else:
        from . import hf_weights

        config = hf_weights.hf_config(src)
        tensors = hf_weights.read_tensors(src, config)
        float_dtype = fmt.dtype or hf_weights.source_dtype(config, tensors)
        config = hf_weights.output_config(config, float_dtype)
        mtp = hf_weights.mtp_tensors(src, config, float_dtype, fmt.bits, fmt.group_size)

        def save_tokenizer(staging: Path) -> None:
            hf_weights.copy_tokenizer(src, staging)
            if mtp:  # the model's own drafter, kept where mlx-lm does not look
                mx.save_safetensors(str(staging / "mtp.safetensors"), mtp)

    return write_model_dir(out, config, tensors, save_tokenizer, fmt, float_dtype, overwrite, progress)


def fastest_dtype() -> Optional[str]:
    """The weight format a conversion writes unless told otherwise, the same for --model
    FILE.gguf and mlx_eagle.convert: float32 on a CPU (MLX's only fast path there), the
    source's own (None) on a GPU."""
    return "float32" if mx.default_device() == mx.cpu else None


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = new_parser("mlx_eagle.convert", __doc__)
    parser.add_argument("src", type=Path, help="a .gguf file or a Hugging Face model directory")
    parser.add_argument("out", type=Path, help="the MLX model directory to write")
    parser.add_argument("--q-bits", type=int, choices=[2, 3, 4, 5, 6, 8], help="quantize weights to this many bits")
    parser.add_argument("--q-group-size", type=int, choices=[32, 64, 128],
                        help="values per quantization group (default 32 from GGUF, 64 otherwise)")
    parser.add_argument("--dtype", choices=list(DTYPES),
                        help="float type of the weights (with --q-bits: of the scales and norms); with neither flag, "
                             "the format that runs fastest here, as --model FILE.gguf converts: float32 on a CPU, "
                             "the source's own on a GPU")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.q_group_size and not args.q_bits:
        parser.error("--q-group-size needs --q-bits")
    dtype = args.dtype or (None if args.q_bits else fastest_dtype())
    out = convert_target(args.src, args.out, args.q_bits, args.q_group_size, dtype, args.overwrite,
                         progress=not args.quiet)
    print(f"wrote {out}")
    if mx.default_device() == mx.cpu:  # said once it worked: an error stays one line
        print("on a CPU float32 weights are the fast path: " + (
            f"{args.q_bits}-bit weights run ~3x slower here and verifying k tokens costs ~k plain steps, so "
            "speculation cannot pay off" if args.q_bits else f"wrote {dtype}" + (
                "" if dtype == "float32" else f"; {dtype} runs ~40x slower than float32 here")), file=sys.stderr)


def cli() -> None:
    """Console-script entry point."""
    run_cli(main)


if __name__ == "__main__":
    cli()
