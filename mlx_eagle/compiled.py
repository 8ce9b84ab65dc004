"""Rounds as a few compiled calls, in one place: the caches inside a compiled call (their
preallocated buffers written in place, ``Buffered``, and the masks that hide what a slot
does not hold), the verify pass as one call per bucket of block sizes (``verify_block``),
and the one switch, ``compiled_rounds`` / ``compiling_rounds``. The head's read of a round's
tokens and its static draft, traced as one call, are built from the same pieces where a
head grows its trees (drafters/tree_growth.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache

from .architectures import ARCHITECTURES
from .target import TargetOutput, compiled_piece, is_driven, target_forward


class Buffered:
    """A KV cache inside a compiled call: its whole preallocated buffer, a block's entries
    written in place where the cache's next ones go (from ``cached`` on), so that the call's
    shapes stay fixed until the buffer grows and nothing already cached is copied. Which
    slots a token sees is its mask's business (cached_mask)."""

    def __init__(self, keys: mx.array, values: mx.array, cached: mx.array):
        self.keys, self.values, self.cached = keys, values, cached
        self.appended = 0  # entries written so far in this call

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Tuple[mx.array, mx.array]:
        at = self.cached + self.appended
        self.keys = mx.slice_update(self.keys, keys, at, axes=(2,))
        self.values = mx.slice_update(self.values, values, at, axes=(2,))
        self.appended += keys.shape[2]
        return self.keys, self.values


def cached_mask(capacity: int, cached: mx.array, ancestors: Optional[mx.array], appended: int,
              rows: int = 1) -> mx.array:
    """Which of a Buffered cache's ``capacity`` slots each of a block's ``rows`` tokens
    sees: the first ``cached``, then, of the ``appended`` entries written after them, its
    ``ancestors`` [rows, appended]. None: a chain's, the rows being the last entries, each
    seeing its own and the ones before it."""
    slots, index, inside = _appended_slots(capacity, cached, appended)
    if ancestors is None:
        own = cached + (appended - rows) + (mx.arange(rows)[:, None] if rows > 1 else 0)
        return slots[None] <= own
    return (slots < cached)[None] | (mx.take(ancestors, index, axis=1) & inside)


def _appended_slots(capacity: int, cached: mx.array, appended: int) -> Tuple[mx.array, mx.array, mx.array]:
    """A Buffered cache's slots; for each, which of the ``appended`` entries written after
    the ``cached`` ones it holds (clipped to one of them) and whether it holds one."""
    slots = mx.arange(capacity)
    after = slots - cached
    return slots, mx.clip(after, 0, appended - 1), (after >= 0) & (after < appended)


def reserve(cache: List, entries: int) -> None:
    """Room in each KVCache's buffer for ``entries`` past those it holds (Buffered writes
    there), grown as mlx-lm grows it: rarely, a step of entries at a time."""
    for layer_cache in cache:
        if layer_cache.offset + entries > layer_cache.keys.shape[2]:
            shape = layer_cache.keys.shape[:2]
            layer_cache.update_and_fetch(mx.zeros(shape + (entries, layer_cache.keys.shape[3]), layer_cache.keys.dtype),
                                         mx.zeros(shape + (entries, layer_cache.values.shape[3]),
                                                  layer_cache.values.dtype))
            layer_cache.trim(entries)


# A decoding round's block is padded to one of these sizes, so that its compiled pass is
# traced once per size (and per cache capacity), not once per round. Fine-grained where
# rounds are: on a CPU each padded token costs about what a real one does.
VERIFY_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)
# Set only through compiling_rounds: True or False, always or never; None, by device.
_chosen: Optional[bool] = None


def compiled_rounds() -> bool:
    """Whether rounds run as compiled calls here: by default where MLX computes on a GPU,
    whose rounds for small models wait on the host building their graphs, which a compiled
    call replays instead; not on a CPU, where a compiled pass attends over its caches' whole
    preallocated buffers and that compute costs more than it saves (SmolLM2 end to end 1-2%
    slower, benchmarks/compiled_rounds.py). ``compiling_rounds`` overrides it."""
    return _chosen if _chosen is not None else mx.default_device().type == mx.gpu


@contextmanager
def compiling_rounds(enabled: Optional[bool]) -> Iterator[None]:
    """Inside the block, rounds made from here on are compiled (True), eager (False) or as
    the device decides (None); then as before. For tests and benchmarks comparing both."""
    global _chosen
    before, _chosen = _chosen, enabled
    try:
        yield
    finally:
        _chosen = before


def compiles_verification(model: nn.Module, cache: List, tokens: int) -> bool:
    """Whether a block of ``tokens`` is verified in one compiled call (verify_block):
    where rounds are compiled, this module drives the model, its layers' caches hold
    entries and the block is a decoding round's. (Latent attention keeps its own path.)"""
    return (compiled_rounds() and tokens <= VERIFY_BUCKETS[-1] and is_driven(model)
            and not ARCHITECTURES[model.args.model_type].latent_attention
            and all(type(layer_cache) is KVCache and layer_cache.keys is not None for layer_cache in cache))


def _verify_graph(model: nn.Module, taps: Optional[Tuple[int, ...]], causal: bool, tokens: mx.array,
                  positions: mx.array, ancestors: mx.array, cached: mx.array, keys: List[mx.array],
                  values: List[mx.array]):
    """target_forward over a padded block, the caches' buffers read and written whole (see
    Buffered): what verify_block compiles (``causal``: a chain's block, whose ``ancestors``
    are not read). Returns the logits, features and hidden states, and the buffers."""
    capacity, size = keys[0].shape[2], tokens.shape[1]
    buffered = [Buffered(k, v, cached) for k, v in zip(keys, values)]
    slots, index, inside = _appended_slots(capacity, cached, size)
    slot_positions = mx.where(inside, positions[index], slots)  # cached entries sit at their slots' positions
    mask = cached_mask(capacity, cached, None if causal else ancestors, size, size)
    out = target_forward(model, tokens, buffered, positions, mask, taps, key_positions=slot_positions)
    return out.logits, out.features, out.hidden, [c.keys for c in buffered], [c.values for c in buffered]


def verify_block(model: nn.Module, tokens: mx.array, cache: List, positions: Sequence[int],
                 ancestors: np.ndarray, taps: Optional[Sequence[int]] = None) -> TargetOutput:
    """target_forward over a decoding round's block ``tokens`` [n] at ``positions``, each
    token attending to every cached entry and to its ``ancestors`` [n, n] in the block,
    appended to ``cache`` as there, as one compiled call (compiles_verification says
    where): the block padded to a bucket, the caches' buffers written in place."""
    count = tokens.size
    size = next(bucket for bucket in VERIFY_BUCKETS if bucket >= count)
    padded_positions = np.full(size, positions[-1], dtype=np.int32)
    padded_positions[:count] = positions
    padded_ancestors = np.eye(size, dtype=bool)  # a padding token sees itself alone
    padded_ancestors[:count, :count] = ancestors
    if size > count:
        tokens = mx.concatenate([tokens, mx.zeros(size - count, dtype=tokens.dtype)])
    reserve(cache, size)
    cached = cache[0].offset
    causal = bool(np.array_equal(ancestors, np.tril(np.ones((count, count), dtype=bool))))  # a chain: a simpler mask
    verify = compiled_piece(model, _verify_graph, count, tuple(taps) if taps is not None else None, causal)
    logits, features, hidden, keys, values = verify(tokens[None], mx.array(padded_positions),
                                                    mx.array(padded_ancestors), mx.array(cached),
                                                    [c.keys for c in cache], [c.values for c in cache])
    # The old buffers, no longer cached, are written in place.
    for layer_cache, layer_keys, layer_values in zip(cache, keys, values):
        layer_cache.keys, layer_cache.values, layer_cache.offset = layer_keys, layer_values, cached + count
    return TargetOutput(logits[0, :count], features[0, :count], hidden[0, :count])
