"""Tensors on their way to an MLX model directory, whatever format they came from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx


@dataclass
class QuantizedWeight:
    """An MLX affine-quantized matrix: ``w = scales * q + biases`` per group of columns."""

    weight: mx.array  # uint32, the q values packed as a little-endian bit stream
    scales: mx.array
    biases: mx.array
    bits: int
    group_size: int


@dataclass
class SourceTensor:
    """One tensor of the source checkpoint, already under its Hugging Face name.

    ``load`` gives the values as floats; ``load_native`` (when set) gives the
    same values as an MLX quantized weight, exactly, without re-quantizing.
    ``requantize_bits`` is how many bits a quantized source that MLX cannot
    hold exactly is re-quantized to when the user asked for no format.
    """

    name: str
    shape: tuple
    load: Callable[[], mx.array]
    load_native: Optional[Callable[[], Optional[QuantizedWeight]]] = None
    native_bits: Optional[int] = None
    requantize_bits: Optional[int] = None
