"""Rewinding the caches mlx-lm cannot cut back: the recurrent state of hybrid models, and
the sliding-window caches of models target.py does not drive, once they wrap.

Qwen3.5/3.6 and Qwen3-Next (Gated DeltaNet), Nemotron-H, Granite 4, Falcon-H1, Jamba and
Mamba 2 (Mamba layers) and LFM2 (short convolutions) keep each recurrent layer's state in
an ``ArraysCache``, which holds only the state after the last token it read: after
verifying k drafts and accepting fewer, there is no state to cut back to.

So the verify pass is recorded: each recurrent layer's convolution input (its previous
conv state, then the pass's rows) and its recurrence's arguments (the state it started
from, and the per-token inputs), by wrapping mlx-lm's own functions and modules, not
copying them. When a draft is rejected part way, the conv state after the accepted tokens
is a slice of that input, and the recurrent state is mlx-lm's recurrence run again from
the recorded start over the accepted steps only: a few small state updates per layer,
no projections, no attention, no MLP (`benchmarks/rollback_cost.py` measures it).
Attention layers in the same model are cut back by their offset, as always.

Where a model's recurrent layers are not ones this module knows (a family the registry
does not record), the round falls back to a snapshot: a layer replaces its state arrays
rather than writing into them, so holding the old arrays keeps the old state; restore it
and read the accepted tokens again in front of the next round's chain (decoder.py).

A ``RotatingKVCache`` (the sliding-window layers of OLMo 3, Cohere 2, Ministral 3, EXAONE
4, ...) can be cut back only until it has wrapped: after that, cutting it moves its write
index over entries it has already overwritten (mlx-lm's own ``is_trimmable`` says so, but
mlx-lm checks it only once, before generating). Its snapshot holds its arrays and indices,
so a round whose verify pass leaves it wrapped restores them and reads the accepted tokens
again.
"""

from __future__ import annotations

import inspect
import sys
import threading
import types
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, CacheList, RotatingKVCache

from .architectures import HYBRID_MODEL_TYPES
from .errors import UserError


@dataclass(frozen=True)
class Recurrence:
    """One of mlx-lm's functions (or methods) that run a recurrent state over a sequence and
    return (outputs, state): its arguments that run along the sequence (axis 1), and the
    one holding the state it starts from. ``replayed`` False: a model with such layers is
    rolled back from a snapshot instead (see RECURRENCES)."""

    sequences: Tuple[str, ...]
    state: str
    replayed: bool = True


# Chosen by measurement (benchmarks/rollback_cost.py): Mamba 2's chunked scan reads a few
# more tokens almost free, while a replay is a chunked scan of its own, dearer than that.
RECURRENCES: Dict[str, Recurrence] = {
    "gated_delta_update": Recurrence(("q", "k", "v", "a", "b", "mask"), "state"),  # Gated DeltaNet, Kimi
    "ssm_step": Recurrence(("x",), "state"),  # Jamba's Mamba, a method of its mixer
    "ssm_update": Recurrence(("hidden_states", "B", "C", "dt", "mask"), "state", replayed=False),  # Mamba 2
}

# The step functions some recurrences call once per token (mlx-lm's ops path for Gated
# DeltaNet, on CPU and CUDA; Jamba's scan), by module and name, with where the state is in
# what they return: the states are kept as they pass, so that a rollback costs nothing.
# (On Metal the Gated DeltaNet runs one kernel over the whole sequence: the accepted steps
# are replayed.)
STEPS: Dict[Tuple[str, str], Optional[int]] = {
    ("mlx_lm.models.gated_delta", "_gated_delta_step_ops"): 1,
    ("mlx_lm.models.jamba", "fma"): None,
}

# On a thread that records a pass: .calls, the list its layers append to; .steps, where the
# recurrence running now keeps its per-step states.
_recording = threading.local()


@dataclass
class _Call:
    """One recurrence call of a recorded pass."""

    function: Callable
    kind: Recurrence
    args: tuple
    kwargs: dict
    outputs: mx.array  # what it returned: the outputs (steps along axis 1), and the state the layer stored
    state: mx.array
    steps: List[mx.array]  # the state after each step, where the backend stepped

    def replay(self, count: int) -> mx.array:
        """The state after the first ``count`` steps of the call."""
        if len(self.steps) == self.outputs.shape[1]:
            return self.steps[count - 1]
        arguments = inspect.signature(self.function).bind(*self.args, **self.kwargs).arguments
        for name in self.kind.sequences:
            if arguments.get(name) is not None:
                arguments[name] = arguments[name][:, :count]
        return self.function(**arguments)[1]


def _recorded(function: Callable, kind: Recurrence) -> Callable:
    def call(*args, **kwargs):
        calls = getattr(_recording, "calls", None)
        if calls is None:
            return function(*args, **kwargs)
        _recording.steps = []
        try:
            outputs = function(*args, **kwargs)
            calls.append(_Call(function, kind, args, kwargs, *outputs, _recording.steps))
        finally:
            _recording.steps = None
        return outputs

    call.__wrapped__ = function
    return call


class _RecordedConv(nn.Module):
    """A recurrent layer's convolution, its input recorded: the conv state, then the new rows."""

    def __init__(self, conv: nn.Module):
        super().__init__()
        self.conv = conv

    def __call__(self, x: mx.array) -> mx.array:
        calls = getattr(_recording, "calls", None)
        if calls is not None:
            calls.append(x)
        return self.conv(x)


def _kept_steps(step: Callable, index: Optional[int]) -> Callable:
    def call(*args, **kwargs):
        outputs = step(*args, **kwargs)
        steps = getattr(_recording, "steps", None)
        if steps is not None:
            steps.append(outputs if index is None else outputs[index])
        return outputs

    call.__wrapped__ = step
    return call


def _install_recurrences(namespaces: Set[types.ModuleType]) -> None:
    """Wrap, once, each recurrence the model's modules call by name (mlx-lm's module-level
    functions), and the step functions under them: the wrappers record only on a thread
    that is recording."""
    for module in namespaces:
        for name, kind in RECURRENCES.items():
            function = getattr(module, name, None)
            if callable(function) and not hasattr(function, "__wrapped__"):
                setattr(module, name, _recorded(function, kind))
    for (module_name, name), index in STEPS.items():
        module = sys.modules.get(module_name)
        step = getattr(module, name, None)
        if callable(step) and not hasattr(step, "__wrapped__"):
            setattr(module, name, _kept_steps(step, index))


def _kinds(cache: Any) -> List[Any]:
    return [c for part in cache.caches for c in _kinds(part)] if isinstance(cache, CacheList) else [cache]


def needs_rewind(caches: List[Any]) -> bool:
    """Whether a model's caches need a Rewind: recurrent states, or sliding-window caches
    that a long enough conversation wraps (KVCache.trim alone cuts back the others)."""
    kinds = [c for cache in caches for c in _kinds(cache)]
    return any(isinstance(c, (ArraysCache, RotatingKVCache)) or not c.is_trimmable() for c in kinds)


class Rewind:
    """Rolls a model's caches back to the state after the accepted part of a verify pass."""

    def __init__(self, model: nn.Module, caches: List[Any], replay: Optional[bool] = None):
        """``replay``: roll back by replaying the recorded pass (True) or from a snapshot
        (False); None: the way measured cheaper for the model's family."""
        self.caches = [c for cache in caches for c in _kinds(cache)]
        for cache in self.caches:
            if not isinstance(cache, (ArraysCache, RotatingKVCache)) and not cache.is_trimmable():
                raise UserError(f"this model's {type(cache).__name__} cannot be rewound, which speculative decoding "
                                "needs; use mlx_lm")
        # Recurrent layers replayed: the registry's hybrid families, but for those whose
        # recurrence a snapshot rolls back for less (RECURRENCES).
        modules = model.modules()
        namespaces = {sys.modules[type(m).__module__] for m in modules}
        found = [kind for name, kind in RECURRENCES.items()
                 if any(callable(getattr(namespace, name, None)) for namespace in namespaces)
                 or any(callable(getattr(type(m), name, None)) for m in modules)]
        known = getattr(getattr(model, "args", None), "model_type", None) in HYBRID_MODEL_TYPES
        self.replays = known and (all(kind.replayed for kind in found) if replay is None else replay)
        # Where the pass's recurrent layers are recorded: their convolutions (by parent, key,
        # and the recording wrapper), and the modules whose methods run their recurrence.
        self.convs = [(parent, key, child, _RecordedConv(child)) for parent in modules
                      for key, child in parent.items() if isinstance(child, nn.Conv1d)] if self.replays else []
        self.methods = [(m, name, kind) for m in modules for name, kind in RECURRENCES.items()
                        if callable(getattr(type(m), name, None))] if self.replays else []
        if self.replays:
            _install_recurrences(namespaces)

    def snapshot(self) -> List[Any]:
        """What each cache holds now: its state arrays (a sliding window's arrays and
        indices), or its length. (Holding the arrays keeps them: the decoder snapshots only
        before a pass over several tokens, which mlx-lm's caches apply by replacing their
        arrays, never by writing into them.)"""
        return [(list(c.cache), c.lengths, c.left_padding) if isinstance(c, ArraysCache) else
                (c.keys, c.values, c.offset, c._idx) if isinstance(c, RotatingKVCache) else c.offset
                for c in self.caches]

    def restore(self, snapshot: List[Any]) -> None:
        for cache, held in zip(self.caches, snapshot):
            if isinstance(cache, ArraysCache):
                cache.cache, cache.lengths, cache.left_padding = list(held[0]), held[1], held[2]
            elif isinstance(cache, RotatingKVCache):
                cache.keys, cache.values, cache.offset, cache._idx = held
            else:
                cache.trim(cache.offset - held)

    def reset(self) -> None:
        """Empty every cache, as a new one is."""
        for cache in self.caches:
            if isinstance(cache, ArraysCache):
                cache.cache, cache.lengths, cache.left_padding = [None] * len(cache.cache), None, None
            elif isinstance(cache, RotatingKVCache):
                cache.keys, cache.values, cache.offset, cache._idx = None, None, 0, 0
            else:
                cache.trim(cache.offset)

    @contextmanager
    def recording(self) -> Iterator[Optional[List[Any]]]:
        """Record the recurrent layers' inputs of the forward pass run inside: their conv
        inputs and recurrence calls, in the order the layers ran (None where this model's
        layers are not ones that replay)."""
        if not self.replays:
            yield None
            return
        calls: List[Any] = []
        try:
            for parent, key, _, recorded in self.convs:
                parent[key] = recorded
            for m, name, kind in self.methods:
                object.__setattr__(m, name, _recorded(getattr(m, name), kind))
            _recording.calls = calls
            yield calls
        finally:
            _recording.calls = None
            for parent, key, child, _ in self.convs:
                parent[key] = child
            for m, name, _ in self.methods:
                object.__delattr__(m, name)

    def cut_back(self, snapshot: List[Any], calls: Optional[List[Any]], count: int) -> bool:
        """Cut every cache back to the state after the first ``count`` tokens the recorded
        pass read since ``snapshot``: conv states sliced from their recorded inputs,
        recurrent states replayed over those steps. False where the recording does not
        account for every state the pass changed, or where a sliding window has wrapped (the
        caller restores the snapshot)."""
        if any(isinstance(c, RotatingKVCache) and not c.is_trimmable() for c in self.caches):
            return False
        if calls is None and any(isinstance(c, ArraysCache) for c in self.caches):
            return False
        calls = calls or []
        convs = iter(c for c in calls if isinstance(c, mx.array))
        replays = {id(c.state): c for c in calls if isinstance(c, _Call)}
        updates = []
        for cache, held in zip(self.caches, snapshot):
            if not isinstance(cache, ArraysCache):
                continue
            if cache.lengths is not None or cache.left_padding is not None:
                return False
            for slot, state in enumerate(cache.cache):
                if state is held[0][slot]:
                    continue  # a layer the pass did not change
                if id(state) in replays:
                    updates.append((cache, slot, replays[id(state)].replay(count)))
                    continue
                conv = next(convs, None)
                if conv is None or conv.ndim != 3 or conv.shape[1] < state.shape[1] + count \
                        or (conv.shape[0], conv.shape[2]) != (state.shape[0], state.shape[2]):
                    return False
                updates.append((cache, slot, conv[:, count:count + state.shape[1]]))
        if next(convs, None) is not None:
            return False
        for cache, slot, state in updates:
            cache.cache[slot] = state
        for cache, held in zip(self.caches, snapshot):
            if not isinstance(cache, ArraysCache):
                cache.trim(cache.offset - (held + count))
        return True
