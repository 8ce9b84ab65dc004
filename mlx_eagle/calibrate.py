"""What a round costs on this device, and the tree that pays most for it.

Speculation pays only where verifying k tokens costs less than k plain steps, and
how much less differs by orders of magnitude between devices: on this repository's
2-core x86 CPU 16 tokens cost ~2.2 plain steps, on an Apple GPU about one. So the
target's forward over k tokens is timed once per device, weight format and
architecture (a few seconds) and cached; lookup drafts size themselves on it, and
``--tree auto`` builds the head's tree from it and the head's recorded acceptance by
(depth, rank) where nobody ran ``python -m mlx_eagle.tune`` (the thorough tool, which
also times whole rounds and checks its tree by decoding).
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import json
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .cli import REFERENCE_BLAS, blas_in_use, openblas_loaded
from .trees import DEFAULT_STATIC, RankPath, TreeSpec, check_paths, parse_tree

CALIBRATION_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 32)


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


# Bumped when the way a verification runs changes (2: through compiled pieces), so that
# timings taken by older code are taken again.
TIMING_VERSION = 3


def model_digest(model: nn.Module) -> str:
    """The target's architecture and sizes (not its weights: timings do not depend on
    them), and the timing version."""
    config = json.dumps([TIMING_VERSION, vars(model.args)], sort_keys=True, default=str)
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


def measure_verify_costs(model: nn.Module, context: int = 256, repeats: int = 2) -> VerifyCosts:
    """Time a verification over k = 1..32 new tokens, ``context`` cached, the way the
    decoder runs it: through target.py's compiled pieces where it knows the architecture,
    else the model's own forward pass."""
    from mlx_lm.models.cache import trim_prompt_cache

    from .target import drives, make_cache, target_forward

    vocab = model.args.vocab_size
    tokens = np.random.default_rng(0).integers(min(100, vocab - 1), max(vocab - 100, 101), size=context + 32)
    cache = make_cache(model)
    mx.eval(model(mx.array(tokens[None, :context]), cache=cache))
    block = mx.array(tokens[None, context:])

    def verify(size: int) -> mx.array:
        if drives(model):
            return target_forward(model, block[:, :size], cache, context, "causal" if size > 1 else None).logits
        return model(block[:, :size], cache=cache)

    timed = []
    for size in CALIBRATION_SIZES:
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            tic = time.perf_counter()
            mx.eval(verify(size))
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
    _save(path, {"device": device_key(model), "verify_ms": costs.ms})
    return costs


def _save(path: Path, record: dict) -> None:
    """Write ``record`` whole or not at all (another process may calibrate alongside); an
    unwritable cache directory only means measuring again next time."""
    partial = path.with_suffix(f".{id(record)}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(record, indent=1))
        partial.replace(path)
    except OSError:
        with contextlib.suppress(OSError):
            partial.unlink()


@dataclass
class Costs:
    verify_ms: Dict[int, float]  # one target forward over k tokens (the root + k - 1 nodes)
    draft_step_ms: float  # one head step over a tree depth
    round_ms: float  # the rest of a round: acceptance, cache compaction, host work
    plain_ms: float  # one token of plain mlx-lm decoding

    def verify(self, tokens: int) -> float:
        sizes = sorted(self.verify_ms)
        return float(np.interp(tokens, sizes, [self.verify_ms[k] for k in sizes]))

    def round(self, nodes: int, depth: int) -> float:
        # One head step per depth, and one to read the previous round's accepted tokens.
        return self.verify(nodes + 1) + (depth + 1) * self.draft_step_ms + self.round_ms


@dataclass
class TreeChoice:
    paths: List[RankPath]  # empty: plain decoding is faster
    expected_tau: float  # tokens per target forward
    expected_tokens_per_s: float
    plain_tokens_per_s: float


def node_values(acceptance: np.ndarray, max_nodes: int, max_depth: int) -> List[Tuple[RankPath, float]]:
    """The best ``max_nodes`` nodes of depth <= ``max_depth``, best first, each with its
    acceptance probability. Best-first over a max-heap: a child is only considered once
    its parent is in, so every prefix of the result is a tree."""
    depths, ranks = acceptance.shape
    heap = [(-acceptance[0][r], (r,)) for r in range(ranks)]
    heapq.heapify(heap)
    chosen: List[Tuple[RankPath, float]] = []
    while heap and len(chosen) < max_nodes:
        negative, path = heapq.heappop(heap)
        if -negative <= 0:
            break
        chosen.append((path, -negative))
        if len(path) < min(max_depth, depths):
            for r in range(ranks):
                heapq.heappush(heap, (negative * acceptance[len(path)][r], path + (r,)))
    return chosen


def best_tree(acceptance: np.ndarray, costs: Optional[Costs], max_nodes: int) -> TreeChoice:
    """The static tree with the most expected tokens per second under ``costs``; with no
    costs, the one with the highest expected tau within ``max_nodes``."""
    best = TreeChoice([], 1.0, 1000 / costs.plain_ms if costs else 0.0, 1000 / costs.plain_ms if costs else 0.0)
    for max_depth in range(1, acceptance.shape[0] + 1):
        nodes = node_values(acceptance, max_nodes, max_depth)
        tau = 1.0
        for count in range(1, len(nodes) + 1):
            tau += nodes[count - 1][1]
            paths = [p for p, _ in nodes[:count]]
            depth = max(len(p) for p in paths)
            speed = 1000 * tau / costs.round(count, depth) if costs else tau
            if speed > best.expected_tokens_per_s + 1e-12:
                best = TreeChoice(check_paths(paths, "tuned"), tau, speed, best.plain_tokens_per_s)
    return best


ACCEPTANCE_FILE = "acceptance.json"  # beside a head: its measured acceptance by (depth, rank)

# For a head with none recorded: the CPU-trained SmolLM2 head's, measured on held-out
# prompts, the weakest real head we know, so an untuned device drafts only where
# verification is nearly free.
PRIOR_ACCEPTANCE = np.array([[0.37, 0.13, 0.06, 0.04], [0.32, 0.10, 0.06, 0.04], [0.27, 0.11, 0.06, 0.05],
                             [0.23, 0.07, 0.07, 0.06], [0.18, 0.10, 0.06, 0.04]])

# The fast path times no whole round, so it leaves out a round's host work (acceptance,
# cache compaction, Python): a tree must be expected this much faster than plain decoding
# to be chosen. On this repository's CPU the shipped head's best tree is expected 1.15x
# and measured slower than plain (tune's check), so the margin sits above that.
CALIBRATED_MARGIN = 1.2


def save_acceptance(head_dir: Path, acceptance: np.ndarray, source: str) -> None:
    """Record a head's measured acceptance by (depth, rank) beside it."""
    record = {"acceptance_by_depth_and_rank": np.asarray(acceptance).round(4).tolist(), "source": source}
    (Path(head_dir) / ACCEPTANCE_FILE).write_text(json.dumps(record, indent=1))


def head_acceptance(head) -> Tuple[np.ndarray, str]:
    """The head's acceptance by (depth, rank) as recorded beside it (by train or tune, or
    in a tree file tuned on any device), else the conservative prior; and where it came from."""
    directory = getattr(head, "directory", None)
    files = [Path(directory) / ACCEPTANCE_FILE] + sorted(Path(directory).glob("trees/*.json")) if directory else []
    for file in files:
        try:
            table = np.array(json.loads(file.read_text())["acceptance_by_depth_and_rank"], dtype=np.float64)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if table.ndim == 2 and table.size and ((table >= 0) & (table <= 1)).all():
            return table, f"acceptance recorded in {file.name}"
    return PRIOR_ACCEPTANCE, "no recorded acceptance, a cautious prior"


def time_draft_step(model: nn.Module, head, context: int = 64, repeats: int = 3) -> float:
    """Milliseconds of one head step over a tree depth (the default static tree's, averaged)."""
    from mlx_lm.models.cache import KVCache

    from .trees import TreeDrafter

    taps = head.taps(model.args.num_hidden_layers)
    width = model.args.hidden_size * (len(taps) if taps is not None else 1)
    tokens = mx.array([[min(100, model.args.vocab_size - 1)] * context])
    cache = [KVCache()]
    out = head.step(model, head.project(mx.zeros((1, context, width))), tokens, cache, 0, "causal")
    mx.eval(out)
    drafter = TreeDrafter(head, model, parse_tree("static:default"))
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        tic = time.perf_counter()
        mx.eval(drafter.draft(out[:, -1], cache, context - 1)[1])
        times.append(time.perf_counter() - tic)
    return 1000 * statistics.median(times[1:]) / max(len(p) for p in DEFAULT_STATIC)


def _head_digest(head) -> Optional[str]:
    """What a calibrated tree depends on in a head directory: its files' names, sizes and
    times, and its recorded acceptance. None for a head not loaded from a directory."""
    directory = getattr(head, "directory", None)
    if directory is None:
        return None
    stats = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in Path(directory).iterdir() if p.is_file())
    return hashlib.sha256(json.dumps([str(Path(directory).resolve()), stats]).encode()).hexdigest()[:12]


def calibrated_tree(model: nn.Module, head) -> Tuple[TreeSpec, str]:
    """The fast path of ``tune``: the best static tree for the head's recorded acceptance
    under this device's timed costs, or no tree; cached per device, weight format, model
    and head, and said once on stderr when first built."""
    from .models import cache_dir

    key = device_key(model)
    digest = _head_digest(head)
    path = cache_dir() / "trees" / f"{key}-{model_digest(model)}-{digest}.json" if digest else None
    if path is not None and path.exists():
        try:
            saved = json.loads(path.read_text())
            paths = check_paths(saved["paths"], str(path)) if saved["paths"] else []
            return _calibrated_spec(paths), saved["why"]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # rebuilt below
    acceptance, source = head_acceptance(head)
    verify = verify_costs(model)
    costs = Costs({k: verify(k) * verify.ms[1] for k in (1, 2, 4, 8, 16, 32, 64)},
                  draft_step_ms=time_draft_step(model, head), round_ms=0.0, plain_ms=verify.ms[1])
    choice = best_tree(acceptance, costs, max_nodes=64)
    gain = choice.expected_tokens_per_s / choice.plain_tokens_per_s
    if gain < CALIBRATED_MARGIN:
        paths, why = [], (f"calibrated for {key} ({source}): no tree is expected to beat plain decoding by "
                          f"{CALIBRATED_MARGIN - 1:.0%} (best {gain:.2f}x)")
    else:
        paths, why = choice.paths, (f"calibrated for {key} ({source}): {len(choice.paths)} nodes, expected tau "
                                    f"{choice.expected_tau:.2f}, {gain:.2f}x plain")
    print(f"tree auto: {why}", file=sys.stderr)
    if path is not None:
        _save(path, {"device": key, "paths": [list(p) for p in paths], "why": why,
                     "costs_ms": {"verify": costs.verify_ms, "draft_step": costs.draft_step_ms}})
    return _calibrated_spec(paths), why


def _calibrated_spec(paths: List[RankPath]) -> TreeSpec:
    return TreeSpec("static", paths, text=f"auto (calibrated: {len(paths)} nodes)") if paths else parse_tree("none")


def tree_file(head_dir: Path, key: str) -> Path:
    return Path(head_dir) / "trees" / f"{key}.json"


def auto_tree(model: nn.Module, head) -> Tuple[TreeSpec, str]:
    """``--tree auto``: the tree ``tune`` built for this device beside the head; untuned,
    the tree the cost model builds from the head's recorded acceptance and this device's
    timed forwards (``calibrated_tree``); no tree where speculation is expected to lose.
    Returns the tree and why it was chosen."""
    key = device_key(model)
    if head is None:
        return parse_tree("none"), "no draft head"
    head_dir = getattr(head, "directory", None)
    path = tree_file(head_dir, key) if head_dir is not None else None
    if path is not None and path.exists():
        tuned = json.loads(path.read_text())
        if not tuned["paths"]:
            measured = tuned.get("measured_tokens_per_s")
            detail = (f"the best tree ran at {measured['tree']:.1f} tokens/s, plain at {measured['plain']:.1f}"
                      if measured else f"no tree is expected to beat {tuned['plain_tokens_per_s']:.1f} tokens/s")
            return parse_tree("none"), f"tuned for {key}: plain decoding is faster here ({detail})"
        spec = TreeSpec("static", check_paths(tuned["paths"], str(path)), text=f"auto ({path})")
        return spec, f"tuned for {key}: {len(spec.paths)} nodes, expected tau {tuned['expected_tau']:.2f}"
    blocker = cpu_blocker(model) if mx.default_device().type == mx.cpu else None
    if blocker is not None:
        return parse_tree("none"), (f"{blocker}: verifying k tokens costs about k times one on a CPU, so "
                                    "speculation cannot pay off")
    return calibrated_tree(model, head)


def cpu_blocker(model: nn.Module) -> Optional[str]:
    """Why a CPU would verify a tree at about k times the cost of one token (and the
    fix), or None where a fast float32 BLAS makes it cheap."""
    weights = weight_format(model)
    if weights != "float32":
        kind = "quantized" if weights.startswith("q") else weights
        return f"{kind} weights (convert with --dtype float32 to speculate)"
    if blas_in_use() == REFERENCE_BLAS:
        return ("MLX's bundled reference BLAS (install OpenBLAS: apt-get install libopenblas0-pthread; "
                "the mlx_eagle commands preload it, Python programs need LD_PRELOAD)")
    return None
