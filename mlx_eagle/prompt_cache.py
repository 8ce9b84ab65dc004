"""A conversation's caches, kept from turn to turn, and the several conversations' caches a
server or an ``Engine`` keeps (``PromptCaches``, the prefix cache): which slot a new prompt
decodes in, what a new conversation copies from a kept one, and what is evicted.

A slot whose prompt read or round did not finish holds nothing certain and is never reused
(``PromptCache.unfinished``); with quantized KV caches a slot is copied only where it holds
what plain decoding of the new prompt would (``KVQuantization.holds_as_plain``).
"""

from __future__ import annotations

import copy
import os
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import ContextManager, List, Optional, Sequence, Tuple

import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import can_trim_prompt_cache

from .drafters import Drafter, common_prefix
from .prompt_store import WORTH_LOADING, PromptStore
from .rewind import Rewind, needs_rewind
from .target import KVQuantization, keep_cache_entries, make_cache


@dataclass
class PromptCache:
    """One conversation's target-side state: the target's caches, the tokens they hold, and
    the drafter drafting for them, kept from turn to turn. Like mlx-lm's cache classes, it
    owns cutting itself back: which beginning of a new prompt it still holds as plain
    decoding would (``reusable``), what a verify pass leaves in it (``before_verify``,
    ``commit``), cutting it to what was handed out (``truncate``), and how far a round may
    go before a quantized cache turns (``room``). Recurrent layers are rolled back through
    ``rewind`` (rewind.py), quantized KV caches follow ``kv`` (target.KVQuantization); both
    are bound by the decoder that takes the cache (``bind``)."""

    target: List
    tokens: List[int] = field(default_factory=list)  # committed; the last (the root) is not in the target cache yet
    drafter: Optional[Drafter] = None  # made by a DraftPlan for this conversation
    plan_key: Tuple = ()  # that plan's key
    unread: int = 0  # committed tokens before the root that the target cache does not hold yet (see rewind.py)
    # Caches that cannot be cut back (a hybrid's recurrent state): a copy kept of them as they
    # were after ``keep_at`` prompt tokens (0: none), the beginning this prompt shares with
    # another conversation's, for later conversations that begin the same way to start from.
    keep_at: int = 0
    beginning: Optional["PromptCache"] = None
    # A prompt read or a round has begun and not finished (cancelled, or an error): until one
    # does, nothing in the caches or the drafter is certain, and no later prompt may use them.
    unfinished: bool = False
    turns: int = 0  # later requests that went on with this conversation in this slot (PromptCaches)
    stored: int = 0  # leading tokens the caches hold that an entry on disk holds too (prompt_store.py)
    # Bound by ``bind``: the model, its caches' quantization, and their rollback (None: they
    # cut back as mlx-lm's do); and before the last round's pass, (snapshot, tokens, unread).
    model: Optional[nn.Module] = field(default=None, repr=False)
    kv: Optional[KVQuantization] = None
    rewind: Optional[Rewind] = field(default=None, repr=False)
    last_round: Optional[Tuple[object, int, int]] = field(default=None, repr=False)

    @property
    def cached(self) -> int:
        """The committed tokens the target cache holds: all but the root and the unread."""
        return len(self.tokens) - 1 - self.unread if self.tokens else 0

    def begin(self) -> List[int]:
        """A prompt read or a round begins: until ``settle``, nothing the caches hold is
        certain (one that never settles leaves the slot ``unfinished``, never reused). The
        tokens committed before it."""
        committed, self.tokens, self.unfinished = self.tokens, [], True
        return committed

    def settle(self, tokens: List[int]) -> None:
        """The read or round has finished: the caches hold exactly ``tokens`` (the last, the
        root, not yet in the target cache), and no beginning is still to be kept."""
        self.tokens, self.unfinished, self.keep_at = tokens, False, 0

    def clear(self, model: nn.Module) -> None:
        """Forget everything: the caches as ``make_prompt_cache`` makes them, no drafter."""
        for name, value in vars(make_prompt_cache(model)).items():
            setattr(self, name, value)

    def bind(self, model: nn.Module, kv: Optional[KVQuantization]) -> None:
        """Take the settings of the decoder that decodes in this cache (one line where ``kv``
        cannot quantize these caches)."""
        if kv is not None:
            kv.check(self.target)
        self.model, self.kv = model, kv
        self.rewind = Rewind(model, self.target) if needs_rewind(self.target) else None
        self.last_round = None

    def reusable(self, prompt: List[int], drafter: Optional[Drafter]) -> int:
        """How many leading tokens of ``prompt`` the caches hold as plain decoding of it
        would (and ``drafter``'s state is still good for), the caches cut back to that. A
        recurrent state, which cannot be cut back, is read again from the start unless the
        prompt continues all it holds; a quantized cache cut back before where plain
        decoding's would turn starts again unquantized."""
        common = common_prefix(self.tokens, prompt)
        cached = self.cached
        reuse = min(common, cached, len(prompt) - 1)
        if drafter is not None:
            reuse = min(reuse, drafter.reusable(common))
        if self.kv is not None and not self.kv.holds_as_plain(self.target, reuse, len(prompt)):
            reuse = 0
            self.target[:] = make_cache(self.model)
        if self.rewind is None:
            keep_cache_entries(self.target, reuse, [])
        elif reuse < cached:
            self.rewind.reset()
            reuse = 0
        self.unread = 0
        self.stored = min(self.stored, reuse)  # (what an entry on disk holds of the caches, cut back too)
        return reuse

    def keep_beginning(self, read: int, prompt: List[int]) -> None:
        """Having read ``read`` prompt tokens: where that is where the slot keeps a copy of
        its caches (PromptCaches), keep one."""
        if read == self.keep_at:
            self.beginning = PromptCache(copy.deepcopy(self.target), list(prompt[:read + 1]))

    def quantize_when_due(self) -> None:
        if self.kv is not None:
            self.kv.quantize_when_due(self.target)

    def room(self, position: int, room: int) -> int:
        """How many tokens a round from ``position`` may produce: where the cache is to turn
        quantized, no further (KVQuantization.room)."""
        return self.kv.room(self.target, position, room) if self.kv is not None else room

    def before_verify(self, nodes: int, committed: int, unread: int) -> ContextManager[Optional[List]]:
        """Before a verify pass over ``nodes`` drafted tokens after ``committed`` tokens (the
        last ``unread`` of them not yet in the caches): what rolls it back later, and the
        context the pass runs in (it records what a rollback replays)."""
        snapshot = self.rewind.snapshot() if self.rewind is not None and nodes else None
        self.last_round = (snapshot, committed, unread)
        return self.rewind.recording() if snapshot is not None else nullcontext()

    def commit(self, start: int, kept: List[int], complete: bool, recorded: Optional[List]) -> None:
        """After the verify pass from position ``start``: keep its rows ``kept`` (0: the
        root's); ``complete``: every drafted row was accepted. A recurrent state that ran past
        a rejected draft is cut back to the accepted prefix, or restored to before the pass,
        its accepted tokens then unread (the next round reads them again)."""
        self.unread = 0
        if self.rewind is None:
            keep_cache_entries(self.target, start, kept)
        elif not complete:
            snapshot, _, unread = self.last_round
            if not self.rewind.cut_back(snapshot, recorded, unread + len(kept)):
                self.rewind.restore(snapshot)
                self.unread = unread + len(kept)

    def truncate(self, count: int) -> bool:
        """Keep only the first ``count`` committed tokens (what was handed out: a round may
        commit tokens past an end of sequence or a stop), so that the next turn's prompt,
        which holds the reply as shown, continues what the caches hold. False where the
        caches cannot be cut there (a recurrent state past its last snapshot): the next
        turn reads from the start."""
        if not 0 < count < len(self.tokens):
            return False
        if self.rewind is None:
            keep_cache_entries(self.target, count - 1, [])
        elif self.last_round is not None and self.last_round[0] is not None and count >= self.last_round[1]:
            snapshot, before, unread = self.last_round  # back to before the last round's forward pass
            self.rewind.restore(snapshot)
            self.unread = count - before + unread
        else:
            return False
        self.tokens = self.tokens[:count]
        return True


def make_prompt_cache(model: nn.Module) -> PromptCache:
    """An empty cache for ``model``; pass it to every turn of one conversation."""
    return PromptCache(target=make_cache(model))


def cache_bytes(cache: PromptCache) -> int:
    """What a conversation's target caches hold, in bytes (its drafter's own are small)."""
    return sum(getattr(layer, "nbytes", 0) for layer in cache.target)


def slots_bytes(slots: List[PromptCache]) -> int:
    """What ``slots`` hold, the beginnings they keep counted once."""
    beginnings = {id(slot.beginning): slot.beginning for slot in slots if slot.beginning is not None}
    return sum(map(cache_bytes, slots)) + sum(map(cache_bytes, beginnings.values()))


def default_cache_bytes(model: nn.Module) -> int:
    """What the conversations' caches may hold by default: twice the model's weights (a
    small model's conversations need no gigabytes), at least 256 MiB (a 27k-token agent
    prompt of a 0.5B model is about 0.7 GB), and at most an eighth of this machine's memory."""
    weights = sum(value.nbytes for _, value in tree_flatten(model.parameters()))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(min(memory // 8, max(256 << 20, 2 * weights)))


class PromptCaches:
    """Several conversations' caches, so that requests that interleave each continue their
    own, and a new conversation that begins as a kept one did (a long system prompt, the
    same tools) does not read that beginning again. A prompt that goes on with what a slot
    holds decodes in that slot; any other starts a slot of its own, from a copy of the
    slot sharing its longest beginning (at least ``MIN_SHARED`` tokens) cut back to that
    beginning, with a copy of that slot's drafters (``Drafter.branch``). Caches that cannot
    be cut back (a hybrid model's recurrent state) are copied from a beginning kept while
    an earlier prompt was read: the first conversation that shares one with a kept slot
    reads it whole and keeps a copy of its caches at the end of what they share, for the
    next ones. While the slots hold more than ``max_bytes``, the least recently used go
    first, those of one request before conversations that went on (a segmented LRU: a
    sweep of one-off prompts leaves a live conversation warm); the slots of replies in
    progress stay. A slot whose prompt read or round did not finish is dropped, never
    reused; with quantized KV caches (``kv``), a slot's caches are copied only where they
    hold what plain decoding of the new prompt would (``KVQuantization.holds_as_plain``).
    ``max_bytes`` None: ``default_cache_bytes``."""

    MIN_SHARED = 16  # fewer shared tokens are not worth a copy (a chat template's header)
    CONTINUES = 0.9  # a prompt sharing this much of what a slot holds goes on with its conversation

    def __init__(self, model: nn.Module, max_bytes: Optional[int] = None, kv: Optional[KVQuantization] = None,
                 store: Optional[PromptStore] = None):
        self.model, self.kv, self.store = model, kv, store
        self.max_bytes = default_cache_bytes(model) if max_bytes is None else max_bytes
        self.slots: List[PromptCache] = []  # the most recently used last

    def take(self, prompt: List[int], busy: Sequence[PromptCache] = ()) -> PromptCache:
        """The slot to decode ``prompt`` in, marked most recently used; never one of ``busy``
        (the slots of replies in progress), though one may be copied from."""
        self.slots = [slot for slot in self.slots if not slot.unfinished or any(slot is b for b in busy)]
        shared, best = max(((common_prefix(slot.tokens, prompt), slot) for slot in self.slots
                            if not slot.unfinished), key=lambda pair: pair[0], default=(0, None))
        if self.store is not None and shared + WORTH_LOADING <= len(prompt):  # (else memory holds all it could)
            kept, entry = self.store.best(prompt)
            if kept >= shared + WORTH_LOADING:
                target = self.store.load(entry)
                if target is not None:
                    best = PromptCache(target, entry.tokens, stored=len(entry.tokens))
                    shared = kept
                    self.slots.append(best)
        if best is not None and shared >= self.CONTINUES * len(best.tokens) and not any(best is b for b in busy):
            self.slots.remove(best)
            slot = best
            slot.turns += 1
        else:
            slot = make_prompt_cache(self.model)
            cached = min(shared, best.cached) if best is not None else 0
            if self.kv is not None and best is not None and not self.kv.holds_as_plain(best.target, cached,
                                                                                      len(prompt)):
                cached = 0
            if cached >= self.MIN_SHARED and can_trim_prompt_cache(best.target):
                self._copy(slot, best, best.target, best.tokens[:cached + 1])
                keep_cache_entries(slot.target, cached, [])
                slot.stored = min(best.stored, cached + 1)
            elif cached >= self.MIN_SHARED:
                origin = self._beginning_of(prompt)
                if origin is not None:
                    self._copy(slot, origin, origin.beginning.target, origin.beginning.tokens)
                    slot.beginning = origin.beginning
                if origin is None or len(origin.beginning.tokens) < cached:
                    # (the root, the last token of a beginning, is shared too: drafters
                    # pairing a state with the next token keep theirs up to it)
                    slot.keep_at = cached - 1
        self.slots.append(slot)
        self.evict(keep=[slot, *busy])
        return slot

    def held(self, prompt: List[int]) -> int:
        """How many leading tokens of ``prompt`` the slots kept in memory hold (what ``take``
        would start it from, short of a copy on disk)."""
        return max((min(common_prefix(slot.tokens, prompt), slot.cached) for slot in self.slots
                    if not slot.unfinished), default=0)

    def _beginning_of(self, prompt: List[int]) -> Optional[PromptCache]:
        """The slot keeping the longest beginning that ``prompt`` begins with (None: none)."""
        fits = [slot for slot in self.slots if slot.beginning is not None
                and common_prefix(slot.beginning.tokens, prompt) == len(slot.beginning.tokens)]
        return max(fits, key=lambda slot: len(slot.beginning.tokens), default=None)

    @staticmethod
    def _copy(slot: PromptCache, source: PromptCache, target: List, tokens: List[int]) -> None:
        """``slot`` starts from a copy of ``target`` holding ``tokens`` (the root, the last, not
        yet read) and of ``source``'s drafters, where they can be copied (else the plan
        makes fresh ones)."""
        slot.target, slot.tokens = copy.deepcopy(target), list(tokens)
        slot.drafter = source.drafter.branch() if source.drafter is not None else None
        slot.plan_key = source.plan_key if slot.drafter is not None else ()

    def keep(self, slot: PromptCache) -> None:
        """A reply in ``slot`` has ended: where the store is kept and the slot holds enough
        that no entry does, save it there (prompt_store.py)."""
        if self.store is not None and not slot.unfinished and not slot.unread and self.store.keeps(
                slot.target, slot.tokens, slot.stored, cache_bytes(slot)):
            self.store.save(slot.target, slot.tokens)
            slot.stored = len(slot.tokens)

    def evict(self, keep: Sequence[PromptCache] = ()) -> None:
        """While all hold more than the bound, drop the least recently used slot (never one of
        ``keep``), a slot used by one request only before any conversation that went on: a
        sweep of unrelated prompts does not push out a conversation still in use."""
        while slots_bytes(self.slots) > self.max_bytes:
            droppable = [slot for slot in self.slots if not any(slot is k for k in keep)]
            if not droppable:
                return
            self.slots.remove(min(droppable, key=lambda slot: slot.turns > 0))  # (min: the first of the least)
