"""Rewinding the caches mlx-lm cannot cut back: the recurrent state of hybrid models.

Qwen3.5/3.6 and Qwen3-Next (Gated DeltaNet), Nemotron-H, Granite 4, Falcon-H1, Jamba and
Mamba 2 (Mamba layers) and LFM2 (short convolutions) keep each recurrent layer's state in
an ``ArraysCache``, which holds only the state after the last token it read: after
verifying k drafts and accepting fewer, there is no state to cut back to. A snapshot is
nearly free, though: a layer replaces its state arrays rather than writing into them, so
holding the old arrays keeps the old state. So a round takes a snapshot before it
verifies a chain, and when a draft is rejected part way it restores the snapshot and
defers reading the accepted tokens again to the next round's forward pass, which reads
them in front of its own chain (decoder.py): where verifying a few more tokens costs about
nothing, as on a GPU, the rollback costs about nothing too. Attention layers in the same
model are rewound by their offset, as always.
"""

from __future__ import annotations

from typing import Any, List

from mlx_lm.models.cache import ArraysCache, CacheList

from .errors import UserError


def _kinds(cache: Any) -> List[Any]:
    return [c for part in cache.caches for c in _kinds(part)] if isinstance(cache, CacheList) else [cache]


class Rewind:
    """Snapshots of a model's caches, restored where a round accepted only part of a chain."""

    def __init__(self, caches: List[Any]):
        self.caches = [c for cache in caches for c in _kinds(cache)]
        for cache in self.caches:
            if not isinstance(cache, ArraysCache) and not cache.is_trimmable():
                raise UserError(f"this model's {type(cache).__name__} cannot be rewound, which speculative decoding "
                                "needs; use mlx_lm")

    def snapshot(self) -> List[Any]:
        """What each cache holds now: its state arrays, or its length."""
        return [(list(c.cache), c.lengths, c.left_padding) if isinstance(c, ArraysCache) else c.offset
                for c in self.caches]

    def restore(self, snapshot: List[Any]) -> None:
        for cache, held in zip(self.caches, snapshot):
            if isinstance(cache, ArraysCache):
                cache.cache, cache.lengths, cache.left_padding = list(held[0]), held[1], held[2]
            else:
                cache.trim(cache.offset - held)

    def reset(self) -> None:
        """Empty every cache, as a new one is."""
        for cache in self.caches:
            if isinstance(cache, ArraysCache):
                cache.cache, cache.lengths, cache.left_padding = [None] * len(cache.cache), None, None
            else:
                cache.trim(cache.offset)
