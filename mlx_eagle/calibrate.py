"""What a round costs on this device: the target's forward pass over k tokens, timed
once per device and weight format and cached.

Speculation pays only where verifying k tokens costs less than k plain steps, and
how much less differs by orders of magnitude between devices: on this repository's
2-core x86 CPU 16 tokens cost ~2.2 plain steps, on an Apple GPU about one. Drafting
decisions (how long a lookup draft to verify) read this curve instead of guessing.
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .cli import openblas_loaded

CALIBRATION_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


@dataclass
class VerifyCosts:
    """Milliseconds of one target forward over k new tokens (after a few hundred cached)."""

    ms: Dict[int, float]

    def __call__(self, tokens: int) -> float:
        """The cost of a forward over ``tokens`` tokens, in plain decoding steps (one token = 1)."""
        sizes = sorted(self.ms)
        values = [self.ms[k] for k in sizes]
        if tokens > sizes[-1]:  # past the curve: grow at its last measured slope
            slope = (values[-1] - values[-2]) / (sizes[-1] - sizes[-2])
            return (values[-1] + slope * (tokens - sizes[-1])) / self.ms[1]
        return float(np.interp(tokens, sizes, values)) / self.ms[1]


def weight_format(model: nn.Module) -> str:
    """The target's weights as its matrices hold them: "q4", "q8", "float32", ..."""
    for module in model.modules():
        if hasattr(module, "bits") and "scales" in module:
            return f"q{module.bits}"
    weights = [v for k, v in tree_flatten(model.parameters()) if k.endswith("weight")]
    return str(weights[0].dtype).split(".")[-1]


def device_key(model: nn.Module) -> str:
    """What timings and tuned trees depend on: the device (and BLAS on CPU) and the
    target's weight format."""
    device = mx.default_device()
    name = platform.machine()
    if device.type == mx.gpu and mx.metal.is_available():
        name = mx.metal.device_info().get("device_name", name)
    elif device.type == mx.cpu and openblas_loaded():
        name += "-openblas"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", f"{device.type.name}-{name}-{weight_format(model)}").lower()


def model_digest(model: nn.Module) -> str:
    """The target's architecture and sizes (not its weights: timings do not depend on them)."""
    config = json.dumps(vars(model.args), sort_keys=True, default=str)
    return hashlib.sha256(config.encode()).hexdigest()[:12]


def non_decreasing(values: Sequence[float]) -> List[float]:
    """The closest non-decreasing sequence (least squares; pool adjacent violators).
    More tokens never cost less to verify; on a noisy machine a dip (10 tokens timed
    below 8) would otherwise make a drafter favour a size for no reason."""
    blocks: List[List[float]] = []  # [mean, count]
    for value in values:
        blocks.append([value, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (mean_a, count_a), (mean_b, count_b) = blocks.pop(-2), blocks.pop()
            blocks.append([(mean_a * count_a + mean_b * count_b) / (count_a + count_b), count_a + count_b])
    return [mean for mean, count in blocks for _ in range(count)]


def measure_verify_costs(model: nn.Module, context: int = 256, repeats: int = 3) -> VerifyCosts:
    """Time the model's own forward pass over k = 1..32 new tokens, ``context`` cached."""
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    vocab = model.args.vocab_size
    tokens = np.random.default_rng(0).integers(min(100, vocab - 1), max(vocab - 100, 101), size=context + 32)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(tokens[None, :context]), cache=cache))
    block = mx.array(tokens[None, context:])
    timed = []
    for size in CALIBRATION_SIZES:
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            tic = time.perf_counter()
            mx.eval(model(block[:, :size], cache=cache))
            times.append(time.perf_counter() - tic)
            trim_prompt_cache(cache, size)
        timed.append(1000 * statistics.median(times[1:]))
    return VerifyCosts(dict(zip(CALIBRATION_SIZES, non_decreasing(timed))))


def verify_costs(model: nn.Module) -> VerifyCosts:
    """This device's verify-cost curve for ``model``: measured once (a few seconds) and
    kept under the cache directory, keyed by device, weight format and architecture."""
    from .models import cache_dir

    path = cache_dir() / "calibration" / f"{device_key(model)}-{model_digest(model)}.json"
    try:
        return VerifyCosts({int(k): float(v) for k, v in json.loads(path.read_text())["verify_ms"].items()})
    except (OSError, ValueError, KeyError, TypeError):
        pass
    print(f"timing this device's forward passes once ({device_key(model)})", file=sys.stderr)
    costs = measure_verify_costs(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{id(costs)}.tmp")
    partial.write_text(json.dumps({"device": device_key(model), "verify_ms": costs.ms}, indent=1))
    partial.replace(path)  # whole or absent, also with another process calibrating alongside
    return costs
