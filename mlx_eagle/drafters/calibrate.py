"""The head's tree for this device: the tree with the most expected tokens per second
under this device's costs (costs.py) and the head's acceptance by (depth, rank).

``--tree auto`` takes the tree ``python -m mlx_eagle.tune`` built for this device and
head (the thorough tool, which also times whole rounds and checks its tree by decoding);
untuned, it builds one here from the head's recorded acceptance and a few timed
forwards, once, and caches it; no tree where speculation is expected to lose.
"""

from __future__ import annotations

import hashlib
import heapq
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache

from .. import costs as device_costs
from ..costs import Costs, device_key, median_ms, model_digest
from ..distributed import share_message, sharded
from .tree_growth import TreeDrafter
from ..errors import UserError
from ..files import cache_dir, read_json, write_json
from ..target import is_driven, layer_count
from ..trees import DEFAULT_STATIC, MAX_RANK, RankPath, TreeSpec, check_paths, node_count, parse_tree


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


ACCEPTANCE_FILE = "acceptance.json"  # a head's measured acceptance by (depth, rank)

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


def user_head_dir(head_dir: Path) -> Path:
    """Where what is measured for the head in ``head_dir`` on this machine is kept (its
    tuned trees, its acceptance): in the user's cache, never beside the head, which may
    be a shipped or read-only one."""
    resolved = str(Path(head_dir).resolve())
    return cache_dir() / "heads" / f"{Path(resolved).name}-{hashlib.sha256(resolved.encode()).hexdigest()[:12]}"


def save_acceptance(directory: Path, acceptance: np.ndarray, source: str) -> None:
    """Record a head's measured acceptance by (depth, rank) in ``directory``."""
    record = {"acceptance_by_depth_and_rank": np.asarray(acceptance).round(4).tolist(), "source": source}
    if not write_json(Path(directory) / ACCEPTANCE_FILE, record):
        raise UserError(f"cannot write {Path(directory) / ACCEPTANCE_FILE}; is the disk full or read-only?")


def _acceptance_table(record: object) -> np.ndarray:
    """A record's acceptance table, or ValueError: a small 2-D table of probabilities."""
    table = record.get("acceptance_by_depth_and_rank") if isinstance(record, dict) else None
    if not isinstance(table, list) or not 0 < len(table) <= 64 or \
            not all(isinstance(row, list) and 0 < len(row) <= MAX_RANK + 1 for row in table) or \
            len({len(row) for row in table}) != 1 or \
            not all(isinstance(p, (int, float)) and not isinstance(p, bool) and 0 <= p <= 1
                    for row in table for p in row):
        raise ValueError("no acceptance table of probabilities by depth and rank")
    return np.array(table, dtype=np.float64)


def _acceptance_files(head) -> List[Path]:
    """Where a head's acceptance may be recorded, the user's own measurement first."""
    directory = getattr(head, "directory", None)
    if directory is None:
        return []
    return ([user_head_dir(directory) / ACCEPTANCE_FILE] + sorted(user_head_dir(directory).glob("trees/*.json"))
            + [Path(directory) / ACCEPTANCE_FILE] + sorted(Path(directory).glob("trees/*.json")))


def head_acceptance(head) -> Tuple[np.ndarray, str]:
    """The head's acceptance by (depth, rank) as recorded for it (by train or tune, or in a
    tree file tuned on any device), else the conservative prior; and where it came from."""
    for file in _acceptance_files(head):
        if not file.exists():
            continue
        try:
            return _acceptance_table(read_json(file)), f"acceptance recorded in {file.name}"
        except ValueError as exc:
            print(f"warning: ignoring {file} ({exc})", file=sys.stderr)
    published = getattr(head, "acceptance", None)  # what peers measure for a kind of drafter (mtp_model.py)
    if published is not None:
        return published, f"the acceptance reported for {head.family} drafters"
    return PRIOR_ACCEPTANCE, "no recorded acceptance, a cautious prior"


def time_draft_step(model: nn.Module, head, context: int = 64, repeats: int = 3) -> float:
    """Milliseconds of one head step over a tree depth (the default static tree's, averaged)."""
    taps = head.taps(layer_count(model))
    width = model.args.hidden_size * (len(taps) if taps is not None else 1)
    tokens = mx.array([[min(100, model.args.vocab_size - 1)] * context])
    cache = [KVCache()]
    out = head.step(model, head.project(mx.zeros((1, context, width))), tokens, cache, 0, "causal")
    mx.eval(out)
    drafter = TreeDrafter(head, model, parse_tree("static:default"))
    step = median_ms(lambda: mx.eval(drafter.draft(out[:, -1], cache, context - 1)[1]), repeats)
    return step / max(len(p) for p in DEFAULT_STATIC)


def _head_digest(head) -> Optional[str]:
    """What a calibrated tree depends on in a head directory: its files' names, sizes and
    times, and its recorded acceptance. None for a head not loaded from a directory."""
    directory = getattr(head, "directory", None)
    if directory is None:
        return None
    files = [p for p in Path(directory).iterdir() if p.is_file()]
    files += [p for p in [user_head_dir(directory) / ACCEPTANCE_FILE] if p.is_file()]
    stats = sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    return hashlib.sha256(repr([str(Path(directory).resolve()), stats]).encode()).hexdigest()[:12]


def _read_tree_record(path: Path) -> dict:
    """A tuned or calibrated tree file: {"paths": rank paths or [], ...}, checked; or
    ValueError naming what is wrong with it."""
    record = read_json(path)
    if not isinstance(record, dict) or not isinstance(record.get("paths"), list):
        raise ValueError('no "paths" list of rank paths')
    if record["paths"]:
        try:
            record["paths"] = check_paths(record["paths"], str(path))
        except UserError as exc:
            raise ValueError(str(exc).split(": ", 1)[-1]) from None
    return record


def _finite(record: dict, name: str) -> Optional[float]:
    value = record.get(name)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and \
        abs(value) < 1e12 else None


def calibrated_tree(model: nn.Module, head) -> Tuple[TreeSpec, str]:
    """The fast path of ``tune``: the best static tree for the head's recorded acceptance
    under this device's timed costs, or no tree; cached per device, weight format, model
    and head, and said once on stderr when first built."""
    key = device_key(model)
    digest = _head_digest(head)
    path = cache_dir() / "trees" / f"{key}-{model_digest(model)}-{digest}.json" if digest else None
    if path is not None and path.exists():
        try:
            saved = _read_tree_record(path)
            why = saved.get("why") if isinstance(saved.get("why"), str) else "calibrated"
            return _calibrated_spec(saved["paths"]), why
        except ValueError as exc:
            print(f"warning: building the tree again: {path} is unusable ({exc})", file=sys.stderr)
    acceptance, source = head_acceptance(head)
    if not is_driven(model):  # a chain: each depth's best token
        acceptance = acceptance[:, :1]
    verify = device_costs.verify_costs(model)
    costs = Costs({k: verify.verify(k) for k in (1, 2, 4, 8, 16, 32, 64)}, draft_step_ms=time_draft_step(model, head))
    choice = best_tree(acceptance, costs, max_nodes=64)
    gain = choice.expected_tokens_per_s / choice.plain_tokens_per_s
    if gain < CALIBRATED_MARGIN:
        paths, why = [], (f"calibrated for {key} ({source}): no tree is expected to beat plain decoding by "
                          f"{CALIBRATED_MARGIN - 1:.0%} (best {gain:.2f}x)")
    else:
        paths, why = choice.paths, (f"calibrated for {key} ({source}): {node_count(len(choice.paths))}, expected tau "
                                    f"{choice.expected_tau:.2f}, {gain:.2f}x plain")
    print(f"tree auto: {why}", file=sys.stderr)
    if path is not None:
        write_json(path, {"device": key, "paths": [list(p) for p in paths], "why": why,
                          "costs_ms": {"verify": costs.verify_ms, "draft_step": costs.draft_step_ms}})
    return _calibrated_spec(paths), why


def _calibrated_spec(paths: List[RankPath]) -> TreeSpec:
    if not paths:
        return parse_tree("none")
    return TreeSpec("static", paths, text=f"auto (calibrated: {node_count(len(paths))})")


def tree_file(head_dir: Path, key: str) -> Path:
    """Where a tree tuned for device ``key`` is shipped beside a head."""
    return Path(head_dir) / "trees" / f"{key}.json"


def tuned_tree_file(head_dir: Path, key: str) -> Path:
    """Where ``tune`` keeps the tree it builds for the head in ``head_dir`` on this machine."""
    return tree_file(user_head_dir(head_dir), key)


def auto_tree(model: nn.Module, head) -> Tuple[TreeSpec, str]:
    """``--tree auto``: the tree ``tune`` built for this device and head (the user's own,
    else one shipped beside the head); untuned, the tree the cost model builds from the
    head's recorded acceptance and this device's timed forwards (``calibrated_tree``); no
    tree where speculation is expected to lose. Returns the tree and why it was chosen.

    Under mlx.launch, rank 0's choice on every rank: each rank's own files and timings could
    choose another (or none), and a rank drafting without the states the others read would
    run other forward passes than theirs (distributed.py)."""
    if not sharded():
        return _auto_tree_here(model, head)
    device_costs.verify_costs(model)  # (timed by every rank together, before any rank's files decide)
    spec, why = _auto_tree_here(model, head)
    chosen = share_message({"paths": [list(p) for p in spec.paths], "text": spec.text, "why": why})
    paths = [tuple(p) for p in chosen["paths"]]
    return (TreeSpec("static", paths, text=chosen["text"]) if paths else parse_tree("none")), chosen["why"]


def _auto_tree_here(model: nn.Module, head) -> Tuple[TreeSpec, str]:
    """``auto_tree`` from this process's files and timings alone."""
    if head is None:
        return parse_tree("none"), "no draft head"
    key = device_key(model)
    head_dir = getattr(head, "directory", None)
    for path in ([tuned_tree_file(head_dir, key), tree_file(head_dir, key)] if head_dir is not None else []):
        if not path.exists():
            continue
        try:
            tuned = _read_tree_record(path)
        except ValueError as exc:
            print(f"warning: ignoring the tuned tree {path} ({exc}); run python -m mlx_eagle.tune to tune again",
                  file=sys.stderr)
            continue
        if not tuned["paths"]:
            measured = tuned.get("measured_tokens_per_s")
            tree, plain = (_finite(measured, "tree"), _finite(measured, "plain")) if isinstance(measured, dict) \
                else (None, None)
            if tree is not None and plain is not None:
                detail = f"the best tree ran at {tree:.1f} tokens/s, plain at {plain:.1f}"
            else:
                detail = f"no tree is expected to beat {_finite(tuned, 'plain_tokens_per_s') or 0:.1f} tokens/s"
            return parse_tree("none"), f"tuned for {key}: plain decoding is faster here ({detail})"
        spec = TreeSpec("static", tuned["paths"], text=f"auto ({path})")
        tau = _finite(tuned, "expected_tau")
        return spec, f"tuned for {key}: {node_count(len(spec.paths))}" + (f", expected tau {tau:.2f}" if tau else "")
    blocker = device_costs.cpu_blocker(model)
    if blocker is not None:
        return parse_tree("none"), (f"{blocker}: verifying k tokens costs about k times one on a CPU, so "
                                    "speculation cannot pay off")
    return calibrated_tree(model, head)
