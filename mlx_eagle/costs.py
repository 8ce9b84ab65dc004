"""What verification costs on this device: the one cost model and the one timer.

Speculation pays only where verifying k tokens costs less than k plain steps, and how
much less differs by orders of magnitude between devices: on this repository's 2-core
x86 CPU 16 tokens cost ~2.2 plain steps, on an Apple GPU about one. So the target's
forward over k tokens is timed once per device, weight format and architecture (a few
seconds) and kept in the user's cache; every drafter sizes its drafts on that curve,
and ``tune`` times the same way with more sizes and repeats.
"""

from __future__ import annotations

import copy
import hashlib
import json
import platform
import re
import statistics
import sys
import time
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import trim_prompt_cache

from .blas import REFERENCE_BLAS, blas_in_use, openblas_loaded
from .compiled import compiles_verification, verify_block
from .distributed import every_rank, first_rank_numbers, sharded, sharding
from .files import cache_dir, read_json, writable, write_json
from .progress import progress_bar
from .target import Block, KVQuantization, is_driven, make_cache, packed_forward, packs, target_forward

CALIBRATION_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 32)
CALIBRATION_CONTEXT = 256  # entries cached while the curve is timed
# The curve is also timed after this many cached entries, at these sizes: attention's share
# of a forward grows with the context it attends to, and faster for a block than for one
# token (a block's queries each read every entry), so verifying k tokens costs more plain
# steps deep in a long context than near its start.
LONG_CONTEXT = 2048
LONG_SIZES = (1, 4, 16)
# Contexts are told apart in steps of this many tokens (what drafters keep per context).
CONTEXT_STEP = 256
# Packed passes of several conversations (target.packed_forward) are timed at these numbers
# of rows, each row's block this many tokens long: a pass over r rows costs more than a
# one-row forward over r tokens (each row attends over its own cache in a call of its own;
# on this repository's CPU 16 rows of one token cost 1.8 times one row of 16).
PACKED_ROWS = (2, 4, 8, 16)
PACKED_PER_ROW = (1, 3)


@dataclass
class Costs:
    """Milliseconds a round's parts take here: ``verify_ms[k]``, one target forward over k
    new tokens (the root and k - 1 nodes, after a few hundred cached); a draft step over
    one tree depth; the rest of a round (acceptance, cache compaction, host work); and one
    token of plain mlx-lm decoding (default: a forward over one token)."""

    verify_ms: Dict[int, float]
    draft_step_ms: float = 0.0
    round_ms: float = 0.0
    plain_ms: Optional[float] = None
    # The largest difference between the target's logits for a block verified in one pass
    # and the same tokens read one at a time, as plain decoding reads them (logit_drift).
    logit_drift: Optional[float] = None
    # The same forwards after LONG_CONTEXT cached entries (None: not timed): costs at other
    # contexts lie on the line through both curves (attention's work is linear in it).
    long_verify_ms: Optional[Dict[int, float]] = None
    # Times them and keeps them in the calibration file (measure_long).
    time_long: Optional[Callable[[], Optional[Dict[int, float]]]] = field(default=None, repr=False, compare=False)
    # With quantized KV caches: the same curves timed over packed keys (MLX's quantized matrix
    # products cost their own, on a CPU several times the float ones), which price a round
    # once the cache holds ``quantized_from`` entries and has turned quantized.
    quantized: Optional["Costs"] = None
    quantized_from: int = 0
    # Packed passes: {rows: {tokens per row: ms}} at PACKED_ROWS x PACKED_PER_ROW (None: not
    # timed yet, or not packing here), and what times them once (measure_packed).
    packed_ms: Optional[Dict[int, Dict[int, float]]] = None
    time_packed: Optional[Callable[[], Optional[Dict[int, Dict[int, float]]]]] = field(default=None, repr=False,
                                                                                      compare=False)

    def __post_init__(self) -> None:
        self.verify_ms = {int(k): float(v) for k, v in sorted(self.verify_ms.items())}
        if self.plain_ms is None:
            self.plain_ms = self.verify(1)

    @property
    def largest_measured(self) -> int:
        return max(self.verify_ms)

    def verify(self, tokens: int, attending: int = CALIBRATION_CONTEXT) -> float:
        """Milliseconds of a forward over ``tokens`` attending to ``attending`` cached entries:
        interpolated between measured sizes; past the largest, extrapolated along the last
        measured slope (never flat: a size nobody timed must not look free); past the
        calibration context, plus what the long curve adds there, growing with the context;
        past ``quantized_from``, the quantized cache's curves'."""
        if self.quantized is not None and attending >= self.quantized_from:
            return self.quantized.verify(tokens, attending)
        near = _along(self.verify_ms, tokens)
        if self.long_verify_ms is None or attending <= CALIBRATION_CONTEXT:
            return near
        per_entry = max(_along(self.long_verify_ms, tokens) - near, 0.0) / (LONG_CONTEXT - CALIBRATION_CONTEXT)
        return near + per_entry * (attending - CALIBRATION_CONTEXT)

    def pass_ms(self, rows: int, tokens: int, attending: int = CALIBRATION_CONTEXT) -> float:
        """Milliseconds of a packed pass over ``tokens`` tokens in ``rows`` conversations'
        blocks: along the timed packed passes (linear in the tokens at each timed number of
        rows, and in the rows between and past them), scaled by what the context adds to a
        one-row forward; a one-row forward over ``tokens`` where none were timed."""
        if rows <= 1 or not self.packed_ms:
            return self.verify(tokens, attending)
        at_rows = {}
        for timed_rows, by_length in self.packed_ms.items():
            short, long = min(by_length), max(by_length)
            slope = max((by_length[long] - by_length[short]) / ((long - short) * timed_rows), 0.0)
            at_rows[timed_rows] = by_length[short] + slope * (tokens - short * timed_rows)
        return _along(at_rows, rows) * self.verify(tokens, attending) / self.verify(tokens)

    def measure_packed(self) -> None:
        """Time packed passes where they are not yet (a few seconds, kept): when a first
        round of several conversations is priced."""
        if self.packed_ms is None and self.time_packed is not None:
            self.packed_ms, self.time_packed = self.time_packed(), None

    def at(self, attending: int = CALIBRATION_CONTEXT, beside: Tuple[int, int] = (0, 1)) -> "Pricing":
        """What a round's forward costs for a conversation attending to ``attending`` entries
        whose block joins a packed pass verifying ``beside`` = (tokens, rows) for the others
        ((0, 1): alone): the value a round's Budget carries."""
        return Pricing(self, CONTEXT_STEP * (attending // CONTEXT_STEP), beside)

    def measure_long(self) -> None:
        """Time the forwards after LONG_CONTEXT entries, where they are not yet (a few seconds,
        kept): once a first prompt that long is read, before its reply's first round
        (stream_generate; a request cancelled while its prompt is read never waits for it)."""
        if self.long_verify_ms is None and self.time_long is not None:
            self.long_verify_ms, self.time_long = self.time_long(), None
        if self.quantized is not None:
            self.quantized.measure_long()

    def round(self, nodes: int, depth: int) -> float:
        """A round verifying ``nodes`` drafted to ``depth``: one draft step per depth and one
        to read the previous round's accepted tokens."""
        return self.verify(nodes + 1) + (depth + 1) * self.draft_step_ms + self.round_ms


@dataclass(frozen=True)
class Pricing:
    """A round's prices for one conversation (Costs.at): its context, rounded to
    CONTEXT_STEP so that drafters can key what they derive from it, and the packed pass its
    block joins. A value: each round's Budget carries its own, and nothing is shared between
    the conversations of a batch."""

    costs: Costs = field(compare=False)
    attending: int = CALIBRATION_CONTEXT
    beside: Tuple[int, int] = (0, 1)  # (tokens, rows) the pass verifies for other conversations

    def verify(self, tokens: int) -> float:
        """Milliseconds of a forward over ``tokens`` at this context (Costs.verify)."""
        return self.costs.verify(tokens, self.attending)

    def steps(self, tokens: int) -> float:
        """A forward over ``tokens`` in plain decoding steps (one token = 1). In a packed
        pass (``beside``: ``others`` tokens of ``rows - 1`` other conversations), a block's
        share of the pass with its root alone plus all its other tokens add,
        ``pass(others + 1) / rows + pass(others + tokens) - pass(others + 1)`` (the packed
        pass's cost over ``rows`` rows: Costs.pass_ms), in steps of a plain batched pass's
        row (its share of a pass over ``rows`` tokens): a
        node then pays where its chance of acceptance per unit of added cost beats the whole
        batch's tokens per unit of cost, as one budget for the batch asks. Under load only
        confident nodes are verified, and none where none pays: the round is plain batching."""
        others, rows = self.beside
        if rows <= 1:
            return self.verify(tokens) / self.verify(1)
        root = self.costs.pass_ms(rows, others + 1, self.attending)
        return (root / rows + self.costs.pass_ms(rows, others + tokens, self.attending) - root) / \
            (self.costs.pass_ms(rows, rows, self.attending) / rows)

    __call__ = steps  # what drafters size themselves with


def _along(curve: Dict[int, float], tokens: int) -> float:
    """A measured curve's milliseconds at ``tokens`` (see Costs.verify)."""
    sizes = list(curve)
    values = list(curve.values())
    if len(sizes) == 1:
        return values[0] * max(tokens, 1) / sizes[0] if tokens > sizes[0] else values[0]
    if tokens > sizes[-1]:
        slope = max((values[-1] - values[-2]) / (sizes[-1] - sizes[-2]), 0.0)
        return values[-1] + slope * (tokens - sizes[-1])
    return float(np.interp(tokens, sizes, values))


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


def timings_ms(run: Callable[[], None], repeats: int) -> List[float]:
    """Milliseconds of each of ``repeats`` calls of ``run``, after one warm-up call."""
    run()
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        run()
        times.append(1000 * (time.perf_counter() - tic))
    return times


def median_ms(run: Callable[[], None], repeats: int) -> float:
    """Median milliseconds of ``run`` over ``repeats`` calls, after one warm-up call."""
    return statistics.median(timings_ms(run, repeats))


def ordinary_tokens(vocab: int, count: int, seed: int) -> np.ndarray:
    """``count`` token ids drawn from the middle of a ``vocab``-sized vocabulary, clear of
    the special tokens at its ends, and every one inside it (an id past the embedding
    reads memory that is not the model's)."""
    low = min(100, vocab // 4)
    return np.random.default_rng(seed).integers(low, max(vocab - 100, vocab - low), size=count)


def time_forwards(model: nn.Module, sizes: Sequence[int] = CALIBRATION_SIZES, context: int = 256,
                  repeats: int = 2, taps: Optional[Sequence[int]] = None, progress: bool = False,
                  kv: Optional[KVQuantization] = None) -> Dict[int, float]:
    """Milliseconds of a target forward over k distinct new tokens for each k in ``sizes``
    (``context`` cached), the way the decoder verifies a chain: one compiled call where
    target.py compiles verification, through its compiled pieces where it drives the
    architecture otherwise (with ``taps``' states), else the model's own forward.
    Distinct tokens, because an MoE verifying one repeated token touches fewer experts
    and would look cheaper than it is. ``kv``: with the cache quantized after the context,
    as ``kv`` quantizes it."""
    tokens = ordinary_tokens(model.args.vocab_size, context + max(sizes), seed=0)
    cache = make_cache(model)
    for start in range(0, context, 512):  # read as a prompt is read: a long context's attention stays small
        model(mx.array(tokens[None, start:min(start + 512, context)]), cache=cache)
        mx.eval([layer_cache.state for layer_cache in cache])
    if kv is not None:
        replace(kv, start=0).quantize_when_due(cache)
    block = mx.array(tokens[None, context:])

    def verify(size: int) -> None:
        if compiles_verification(model, cache, size):
            out = verify_block(model, block[0, :size], cache, list(range(context, context + size)),
                               np.tri(size, dtype=bool), taps)
            mx.eval(out.logits, out.features)
        elif is_driven(model):
            out = target_forward(model, block[:, :size], cache, context, "causal" if size > 1 else None, taps)
            mx.eval(out.logits, out.features)
        else:
            mx.eval(model(block[:, :size], cache=cache))
        trim_prompt_cache(cache, size)

    # The fastest of the repeats: a forward is never faster than the device allows, and a
    # curve kept for good must not keep what another program's burst added to one repeat
    # (a 16-token forward timed at 264 ms on this repository's CPU, 110 idle: every draft
    # priced 2.4 times dearer than it was).
    timed = [min(timings_ms(lambda size=size: verify(size), repeats))
             for size in progress_bar(sizes, desc="timing verification", disable=not progress)]
    return dict(zip(sizes, non_decreasing(timed)))


def time_packed_passes(model: nn.Module, rows: Sequence[int] = PACKED_ROWS, per_row: Sequence[int] = PACKED_PER_ROW,
                       context: int = CALIBRATION_CONTEXT, repeats: int = 2) -> Dict[int, Dict[int, float]]:
    """Milliseconds of a packed pass (target.packed_forward) over each number of ``rows``
    conversations, ``context`` cached each, each row's block ``per_row`` distinct new tokens
    (a causal block, as a chain is verified): {rows: {tokens per row: ms}}, the fastest of
    the repeats (see time_forwards)."""
    tokens = ordinary_tokens(model.args.vocab_size, context + max(per_row), seed=2)
    first = make_cache(model)
    mx.eval(model(mx.array(tokens[None, :context]), cache=first))
    caches = [first] + [copy.deepcopy(first) for _ in range(max(rows) - 1)]
    block = mx.array(tokens[context:])

    def packed(count: int, length: int) -> None:
        outs = packed_forward(model, [Block(block[:length], cache, context, "causal" if length > 1 else None)
                                      for cache in caches[:count]])
        mx.eval([out.logits for out in outs])
        for cache in caches[:count]:
            trim_prompt_cache(cache, length)

    return {count: {length: min(timings_ms(lambda count=count, length=length: packed(count, length), repeats))
                    for length in per_row} for count in rows}


def check_packed(value: object) -> Optional[Dict[int, Dict[int, float]]]:
    """A calibration file's ``packed_ms`` as {rows: {tokens per row: ms}}, or None where
    it is missing or damaged (then timed again when first needed)."""
    if not isinstance(value, dict) or sorted(value) != sorted(str(r) for r in PACKED_ROWS):
        return None
    checked: Dict[int, Dict[int, float]] = {}
    for rows in PACKED_ROWS:
        by_length = value[str(rows)]
        if not isinstance(by_length, dict) or sorted(by_length) != sorted(str(n) for n in PACKED_PER_ROW) or \
                not all(isinstance(ms, (int, float)) and not isinstance(ms, bool) and 0 < ms < MAX_CALIBRATION_MS
                        for ms in by_length.values()):
            return None
        checked[rows] = {length: float(by_length[str(length)]) for length in PACKED_PER_ROW}
    return checked


def logit_drift(model: nn.Module, context: int = 256, size: int = 16, kv: Optional[KVQuantization] = None,
                rows: int = 8) -> float:
    """How far the target's logits for ``size`` tokens verified in one pass (as the decoder
    verifies a chain) lie from the same tokens read one at a time through the model's own
    forward pass (as plain mlx-lm decodes): kernels differ by shape (a matrix-vector
    product for one row, a matrix product for a block), and so do their roundings. Where
    conversations share a packed pass (target.packed_forward, decoder.batched_round), also
    for the block beside ``rows - 1`` others, whose products see ``rows`` times the rows:
    the larger of the two. The decoder decides a greedy position whose top two logits lie
    closer than this (with a margin) as plain decoding would. ``kv``: with the cache
    quantized after the context, as it is once quantized KV caches start: the quantized
    kernels' roundings drift further."""
    tokens = ordinary_tokens(model.args.vocab_size, context + size, seed=1)
    cache = make_cache(model)
    mx.eval(model(mx.array(tokens[None, :context]), cache=cache))
    if kv is not None:
        replace(kv, start=0).quantize_when_due(cache)
    others = [copy.deepcopy(cache) for _ in range(rows - 1)] if packs(model) else []
    block = mx.array(tokens[None, context:])
    if is_driven(model):
        together = [target_forward(model, block, cache, context, "causal").logits[0]]
        trim_prompt_cache(cache, size)
        if others:
            together.append(packed_forward(model, [Block(block[0], c, context, "causal") for c in [cache] + others])
                            [0].logits)
            trim_prompt_cache(cache, size)
    else:
        together = [model(block, cache=cache)[0]]
        trim_prompt_cache(cache, size)
    mx.eval(together)
    alone = mx.concatenate([model(block[:, i:i + 1], cache=cache)[0] for i in range(size)]).astype(mx.float32)
    return max(float(mx.abs(logits.astype(mx.float32) - alone).max().item()) for logits in together)


MAX_DRIFT = 1e3


def kv_logit_drift(model: nn.Module, kv: KVQuantization) -> float:
    """``logit_drift`` with the cache quantized as ``kv`` quantizes it (measured once per
    device and setting, with its cost curve, and kept)."""
    return _measured(model, kv).logit_drift


def check_drift(value: object) -> Optional[float]:
    """A calibration file's ``logit_drift``, or None where it holds none usable."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < MAX_DRIFT:
        return None
    return float(value)


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
    shards = f"-{sharding(model)}" if sharding(model) else ""  # a shard's forwards cost their own
    return re.sub(r"[^A-Za-z0-9._-]+", "-", f"{device.type.name}-{name}-{weight_format(model)}{shards}").lower()


# Bumped when the way a verification runs or is timed changes, so that timings taken by
# older code are taken again (5: the fastest of the repeats, not their median).
TIMING_VERSION = 5


def model_digest(model: nn.Module) -> str:
    """The target's architecture and sizes (not its weights: timings do not depend on
    them), and the timing version."""
    config = json.dumps([TIMING_VERSION, vars(model.args)], sort_keys=True, default=str)
    return hashlib.sha256(config.encode()).hexdigest()[:12]


def cpu_blocker(model: nn.Module) -> Optional[str]:
    """Why a CPU would verify k tokens at about k times the cost of one (and the fix), or
    None where a fast float32 BLAS makes it cheap (or the device is not a CPU)."""
    if mx.default_device().type != mx.cpu:
        return None
    weights = weight_format(model)
    if weights != "float32":
        kind = "quantized" if weights.startswith("q") else weights
        return f"{kind} weights (convert with --dtype float32 to speculate)"
    if blas_in_use() == REFERENCE_BLAS:
        return ("MLX's bundled reference BLAS (install OpenBLAS: apt-get install libopenblas0-pthread; "
                "the mlx_eagle commands preload it, Python programs need LD_PRELOAD)")
    return None


# A curve that says two tokens cost more than this many single ones was timed while
# something else held the machine: it is timed again rather than believed.
CONTRADICTION = 2.0
MAX_CALIBRATION_MS = 1e7  # ~3 hours for one forward: no real timing, a damaged file


def check_curve(record: object) -> Dict[int, float]:
    """A calibration file's ``verify_ms`` as {tokens: ms}, or ValueError naming what is
    wrong: not an object, sizes that are not whole numbers, times that are not positive
    finite numbers, no single-token time, or a curve that contradicts itself."""
    curve = record.get("verify_ms") if isinstance(record, dict) else None
    if not isinstance(curve, dict) or len(curve) < 2:
        raise ValueError("no verify_ms curve of two or more sizes")
    checked = {}
    for size, ms in curve.items():
        if not (isinstance(size, str) and size.isascii() and size.isdigit() and 0 < len(size) < 4):
            raise ValueError(f"size {size!r} is not a whole number of tokens")
        # compared before any float conversion: a 400-digit integer must not overflow (NaN fails too)
        if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not 0 < ms < MAX_CALIBRATION_MS:
            raise ValueError(f"time {ms!r} for {size} tokens is not a positive number of milliseconds")
        checked[int(size)] = float(ms)
    if 1 not in checked:
        raise ValueError("no time for one token")
    if 2 in checked and checked[2] > CONTRADICTION * checked[1]:
        raise ValueError(f"2 tokens timed at {checked[2]:.0f} ms against {checked[1]:.0f} ms for one "
                         "(measured under load)")
    return checked


def _rank_0s(curve: Dict[int, float], drift: float, long_curve: Optional[Dict[int, float]]):
    """Rank 0's curve, drift and long curve on every rank (the long curve where every rank has one)."""
    has_long = every_rank(long_curve is not None and set(long_curve) == set(LONG_SIZES))
    sizes = list(curve) + (list(LONG_SIZES) if has_long else [])
    values = first_rank_numbers(list(curve.values()) + (list(long_curve.values()) if has_long else []) + [drift])
    shared = dict(zip(sizes[:len(curve)], values))
    return shared, values[-1], (dict(zip(LONG_SIZES, values[len(curve):-1])) if has_long else None)


def calibration_file(model: nn.Module, kv: Optional[KVQuantization] = None) -> Path:
    """Where this device's curves for ``model`` are kept (``kv``: those over a cache quantized so)."""
    setting = f"-kv{kv.bits}g{kv.group_size}" if kv is not None else ""
    return cache_dir() / "calibration" / f"{device_key(model)}-{model_digest(model)}{setting}.json"


# Per model object (weakly held), calibration file and quantization start: a process reads or
# times a curve once, and every caller of one setting shares its Costs (and what it attends to).
_CURVES: Dict[Tuple[int, Path, Optional[int]], Tuple["weakref.ref", Costs]] = {}


def _keep(key: Tuple[int, Path, Optional[int]], model: nn.Module, costs: Costs) -> None:
    """Keep ``costs`` for ``model`` while it lives, dropping what freed models left."""
    for dead in [k for k, (ref, _) in _CURVES.items() if ref() is None]:
        del _CURVES[dead]
    _CURVES[key] = (weakref.ref(model), costs)


def verify_costs(model: nn.Module, kv: Optional[KVQuantization] = None) -> Costs:
    """This device's verify-cost curve for ``model``: timed once (a few seconds) and kept
    in the user's cache, keyed by device, weight format and architecture. A cached curve
    that is damaged or contradicts itself is timed again, with one line saying why; so is
    a fresh timing that contradicts itself (taken under load), up to twice. ``kv``: quantized
    KV caches as the user's setting quantizes them, whose blocks past ``kv.start`` entries
    are priced by curves timed over packed keys (once per setting, kept beside the others)."""
    if kv is None:
        return _measured(model, None)
    key = (id(model), calibration_file(model, kv), kv.start)
    known = _CURVES.get(key)
    if known is not None and known[0]() is model:
        return known[1]
    costs = replace(_measured(model, None), quantized=_measured(model, kv), quantized_from=kv.start)
    _keep(key, model, costs)
    return costs


def _measured(model: nn.Module, kv: Optional[KVQuantization]) -> Costs:
    """The curves and drift of one calibration file (``kv``: over a cache quantized so),
    read, or timed and kept (see verify_costs)."""
    path = calibration_file(model, kv)
    known = _CURVES.get((id(model), path, None))
    if known is not None and known[0]() is model:
        return known[1]
    setting = device_key(model) + (f", {kv.bits}-bit KV cache" if kv is not None else "")
    curve, drift, long_curve, packed, record = None, None, None, None, {}
    if path.exists():
        try:
            record = read_json(path)
            curve, drift = check_curve(record), check_drift(record.get("logit_drift"))
            packed = check_packed(record.get("packed_ms"))
            if isinstance(record.get("long_verify_ms"), dict):
                long_curve = check_curve({"verify_ms": record["long_verify_ms"]})
        except ValueError as exc:
            print(f"warning: timing again: the calibration {path} is unusable ({exc})", file=sys.stderr)
            record = {}
    if sharded() and not every_rank(curve is not None and set(curve) == set(CALIBRATION_SIZES) and drift is not None):
        curve, drift = None, None  # the forwards are collectives: every rank times them, or none does
    timed_now = curve is None or drift is None
    if curve is None:
        kept = writable(path.parent)
        print(f"timing this device's forward passes {'once' if kept else 'for this run'} ({setting})"
              + ("" if kept else f"; {path.parent} is not writable: set MLX_EAGLE_CACHE to a writable directory "
                                 "to time once"), file=sys.stderr)
        for _ in range(1 if sharded() else 3):  # (ranks must agree on how many times they time)
            timed = time_forwards(model, kv=kv)
            try:
                curve = check_curve({"verify_ms": {str(k): v for k, v in timed.items()}})
                break
            except ValueError:
                curve = timed  # kept if every attempt is disturbed: the best this machine gives now
    if drift is None:
        drift = logit_drift(model, kv=kv)
    record = {"device": device_key(model), "verify_ms": curve, "logit_drift": drift, "long_verify_ms": long_curve,
              "packed_ms": packed}

    def keep() -> None:
        if writable(path.parent) and not write_json(path, record):
            print(f"note: could not keep the timing in {path.parent} (full?); set MLX_EAGLE_CACHE to a writable "
                  "directory to time once", file=sys.stderr)

    model_ref = weakref.ref(model)  # (the curves are kept per process: they must not keep the model alive)

    def time_long() -> Optional[Dict[int, float]]:
        model, needed = model_ref(), LONG_CONTEXT + max(LONG_SIZES)
        if model is None or (getattr(model.args, "max_position_embeddings", None) or 0) <= needed:
            return None
        print(f"timing this device's forward passes after {LONG_CONTEXT} tokens, once ({setting})", file=sys.stderr)
        record["long_verify_ms"] = time_forwards(model, LONG_SIZES, context=LONG_CONTEXT, kv=kv)
        keep()
        return record["long_verify_ms"]

    def time_packed() -> Optional[Dict[int, Dict[int, float]]]:
        model = model_ref()
        if model is None:
            return None
        print(f"timing this device's packed passes of several conversations, once ({setting})", file=sys.stderr)
        record["packed_ms"] = time_packed_passes(model)
        keep()
        return record["packed_ms"]

    if timed_now:
        keep()
    if sharded():  # every rank sizes its drafts and rechecks by rank 0's numbers
        curve, drift, long_curve = _rank_0s(curve, drift, long_curve)
    # (a packed pass runs a target driven whole on this machine, with plain KV caches)
    packs_here = packs(model) and kv is None and not sharded()
    costs = Costs(curve, logit_drift=drift, long_verify_ms=long_curve,
                  time_long=time_long if long_curve is None and not sharded() else None,
                  packed_ms=packed if packs_here else None,
                  time_packed=time_packed if packed is None and packs_here else None)
    _keep((id(model), path, None), model, costs)
    return costs
