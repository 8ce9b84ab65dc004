"""Which BLAS MLX's CPU matmuls run on, and where the system's OpenBLAS is: float32 on
MLX's bundled reference BLAS is ~30x slower than on OpenBLAS, which only a library loaded
before the process starts can replace (cli.use_fast_blas restarts commands with it)."""

from __future__ import annotations

import os
import sys
from typing import Optional

# Debian/Ubuntu, Fedora and Arch put OpenBLAS in one of these.
_OPENBLAS_PATHS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


def find_openblas() -> Optional[str]:
    """Path of the system OpenBLAS, or None. ``MLX_EAGLE_OPENBLAS`` overrides."""
    override = os.environ.get("MLX_EAGLE_OPENBLAS")
    if override:
        return override if os.path.exists(override) else None
    return next((p for p in _OPENBLAS_PATHS if os.path.exists(p)), None)


def openblas_loaded() -> bool:
    try:
        with open("/proc/self/maps") as maps:
            return "libopenblas" in maps.read()
    except OSError:
        return False


REFERENCE_BLAS = "MLX's bundled reference BLAS"


def blas_in_use() -> str:
    """A short description of the BLAS that MLX's CPU matmuls run on."""
    if sys.platform == "darwin":
        return "Accelerate"
    if openblas_loaded():
        return "OpenBLAS (preloaded)"
    return REFERENCE_BLAS
