"""How a head grows a draft tree each round (an EAGLE head, or a model's MTP module read
as one): a static tree's depths gathered by fixed index arithmetic, in one compiled call
where rounds are compiled; a dynamic tree (EAGLE-2) expanded by score, depth by depth.
The tree itself is data (trees.py); the drafters that grow one are eagle.py and mtp.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..errors import UserError
from ..compiled import Buffered, compiled_rounds, cached_mask, reserve
from ..target import COMPILED_TOKENS, PackedCache, cuts_of, is_driven, keep_cache_entries, tree_mask
from ..trees import DraftTree, RankPath, TreeSpec


@dataclass
class _Level:
    """One depth of a static tree as index arithmetic, the same every round. An index that
    takes everything in order is None (see _gather)."""

    picks: Optional[mx.array]  # this depth's tokens: flat indices into the top ids of the level above
    grows: bool = False  # whether the head runs on any of them (those with children)
    expand: Optional[mx.array] = None  # which of them it runs on
    parent_rows: Optional[mx.array] = None  # their parents' rows among the level above's head outputs
    ancestors: Optional[mx.array] = None  # [expanded, tree slots so far]: what each may attend to; None: all


def _gather(indices: List[int], length: int) -> Optional[mx.array]:
    """``indices`` as an array, or None where they take all ``length`` items in order (a
    chain's levels): one operation fewer per depth."""
    return None if indices == list(range(length)) else mx.array(indices)


def _take(values: mx.array, indices: Optional[mx.array]) -> mx.array:
    """``values`` [rows, items, ...] at ``indices`` of each row's items."""
    return values if indices is None else values[:, indices]


def _static_levels(paths: List[RankPath], ranks: int) -> Tuple[DraftTree, List[_Level]]:
    """A static tree's shape and, per depth, where its tokens come from."""
    index = {path: node for node, path in enumerate(paths)}
    shape = DraftTree()
    for path in paths:
        shape.parents.append(index[path[:-1]] if len(path) > 1 else -1)
        shape.depths.append(len(path))
    parents_of_children = {path[:-1] for path in paths}
    expanded = [node for node, path in enumerate(paths) if path in parents_of_children]
    slot = {node: position for position, node in enumerate(expanded)}
    levels, above = [], [-1]  # the nodes whose head outputs the next depth reads; -1 the root
    for depth in range(1, max(shape.depths) + 1):
        nodes = [n for n in range(len(paths)) if shape.depths[n] == depth]
        row_above = {node: row for row, node in enumerate(above)}
        level = _Level(picks=_gather([row_above[shape.parents[n]] * ranks + paths[n][-1] for n in nodes],
                                     len(above) * ranks))
        grow = [n for n in nodes if n in slot]
        if grow:
            ancestors = np.zeros((len(grow), slot[grow[-1]] + 1), dtype=bool)
            for row, node in enumerate(grow):
                while node >= 0:
                    ancestors[row, slot[node]] = True
                    node = shape.parents[node]
            level.grows = True
            level.expand = _gather([nodes.index(n) for n in grow], len(nodes))
            level.parent_rows = _gather([row_above[shape.parents[n]] for n in grow], len(above))
            # A chain's node sees every slot so far: no mask at all, as for one token.
            level.ancestors = None if ancestors.all() else mx.array(ancestors)
        levels.append(level)
        above = grow
    return shape, levels


class TreeDrafter:
    """Grows a draft tree with the head, one batched draft step per depth.

    A static tree's shape is known before the round, so it is drafted without leaving
    the device: each depth's tokens are gathered from the top ids of the depth above at
    indices fixed per shape. With a head whose step is array code only (``traceable``) on a
    target this package drives, every depth, the top-k and the index arithmetic are one
    compiled call, and so is the head's read of the tokens the round committed before it
    (``read_and_draft``): the head's cache enters as its preallocated buffer (compiled.Buffered)
    and a count of the entries that are committed, so the call's shapes change only when
    the buffer grows, and the host replays one traced graph instead of building one depth
    by depth in Python. A dynamic tree (EAGLE-2) chooses what to expand by score, reading
    each depth's top ids once; with such a head each depth is one compiled call.
    """

    def __init__(self, head, target, spec: TreeSpec, compiled: Optional[bool] = None):
        """``compiled``: draft in compiled calls where the head allows it (None: where
        compiled.compiled_rounds says; tests compare both)."""
        self.head, self.target, self.spec = head, target, spec
        self.compiled = self.compiled_expand = None
        compiling = (compiled_rounds() if compiled is None else compiled) and getattr(head, "traceable", False) \
            and is_driven(target)
        if spec.kind == "dynamic" and compiling:
            self.compiled_expand = mx.compile(self._expand_graph, inputs=[head, target])
        if spec.kind == "static":
            paths = sorted(spec.paths, key=lambda p: (len(p), p))
            self.ranks = max(max(p) for p in paths) + 1
            self.shape, self.levels = _static_levels(paths, self.ranks)
            self.slots = len({p for p in self.shape.parents if p >= 0})  # head cache entries: nodes with children
            if compiling:
                # The weights are the call's inputs, read at every call (a head being trained changes).
                self.compiled = mx.compile(self._static_graph, inputs=[head, target])
                self.compiled_read = mx.compile(self._read_and_draft_graph, inputs=[head, target])
        config = getattr(head, "config", None)
        vocabulary = getattr(config, "draft_vocab_size", None) or getattr(config, "vocab_size", None)
        wanted = self.ranks if spec.kind == "static" else spec.topk
        if vocabulary is not None and wanted > vocabulary:
            raise UserError(f"tree {spec.text}: it takes the {wanted} best drafts of a node, but the head drafts from "
                            f"a vocabulary of {vocabulary}; use ranks below {vocabulary}")

    def draft(self, root_hidden: mx.array, cache: List, root_position: int) -> Tuple[DraftTree, mx.array]:
        """``root_hidden`` [1, H]: the head's output at the root; ``cache``: the
        committed draft cache (left as it was); ``root_position``: the root's position.
        Returns the tree and its tokens [n] (not yet read to the host)."""
        committed = cache[0].offset
        try:
            if self.spec.kind == "dynamic":
                tree = self._dynamic(_Growth(self, root_hidden, cache, root_position))
                return tree, mx.array(tree.tokens, dtype=mx.int32)
            return self._static(root_hidden, cache, root_position)
        finally:
            keep_cache_entries(cache, committed, [])

    def reads_and_drafts(self, tokens: int, cache: List) -> bool:
        """Whether ``read_and_draft`` can take ``tokens`` committed tokens in one call."""
        return self.compiled is not None and cache[0].keys is not None and tokens <= COMPILED_TOKENS

    def read_and_draft(self, features: mx.array, tokens: mx.array, cache: List) -> Tuple[DraftTree, mx.array]:
        """The head run over the committed ``tokens`` [n] with the target's ``features``
        [n, F] at them, their entries kept in ``cache``, and the next static tree drafted
        from its last output: one compiled call (where ``reads_and_drafts``)."""
        committed, count = cache[0].offset, tokens.size
        reserve(cache, count + self.slots)
        tree_tokens, cache[0].keys, cache[0].values = self.compiled_read(
            features, tokens, cache[0].keys, cache[0].values, mx.array(committed))
        cache[0].offset = committed + count
        return self._shape(), tree_tokens

    def _read_and_draft_graph(self, features: mx.array, tokens: mx.array, keys: mx.array, values: mx.array,
                              committed: mx.array) -> Tuple[mx.array, mx.array, mx.array]:
        """``read_and_draft`` as one function of arrays: what ``compiled_read`` traces."""
        count = tokens.shape[0]
        buffered = Buffered(keys, values, committed)
        out = self.head.step(self.target, self.head.project(features)[None], tokens[None], [buffered],
                             committed + mx.arange(count), cached_mask(keys.shape[2], committed, None, count, count))
        return self._static_graph(out[:, -1], buffered.keys, buffered.values, committed + count,
                                  committed + count - 1)

    def top_ids(self, hidden: mx.array, k: int) -> mx.array:
        """The draft's k best target ids for each row of ``hidden``, best first."""
        logits = self.head.logits(self.target, hidden)
        if k == 1:
            return self.head.target_ids(mx.argmax(logits, axis=-1, keepdims=True))
        draft_ids = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]
        order = mx.argsort(-mx.take_along_axis(logits, draft_ids, axis=-1), axis=-1)
        return self.head.target_ids(mx.take_along_axis(draft_ids, order, axis=-1))

    def top(self, hidden: mx.array, k: int) -> Tuple[np.ndarray, np.ndarray]:
        """Top-k (target ids, log-probabilities) of the draft for each row of ``hidden``,
        read to the host together."""
        return _read(*self._top_graph(hidden, k))

    def _top_graph(self, hidden: mx.array, k: int) -> Tuple[mx.array, mx.array]:
        logits = self.head.logits(self.target, hidden).astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        k = min(k, logprobs.shape[-1])
        draft_ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[..., :k]
        top_logprobs = mx.take_along_axis(logprobs, draft_ids, axis=-1)
        order = mx.argsort(-top_logprobs, axis=-1)
        ids = self.head.target_ids(mx.take_along_axis(draft_ids, order, axis=-1))
        return ids, mx.take_along_axis(top_logprobs, order, axis=-1)

    def _expand_graph(self, hidden: mx.array, tokens: mx.array, keys: mx.array, values: mx.array,
                      committed: mx.array, written: mx.array, position: mx.array,
                      ancestors: mx.array) -> Tuple[mx.array, ...]:
        """One depth of a dynamic tree as one function of arrays (what ``compiled_expand``
        traces, once per depth's shape): the head over ``tokens`` [1, n], their entries
        written into the head cache's buffer from ``written`` on, each seeing the
        ``committed`` entries and its ``ancestors`` [n, tree entries] among the tree's
        (written after them); returns its outputs [n, H], their top-k (ids and
        log-probabilities) and the buffers."""
        buffered = Buffered(keys, values, written)
        mask = cached_mask(keys.shape[2], committed, ancestors, ancestors.shape[1], ancestors.shape[0])
        out = self.head.step(self.target, hidden, tokens, [buffered], position, mask)[0]
        return (out, *self._top_graph(out, self.spec.topk), buffered.keys, buffered.values)

    def _static(self, root_hidden: mx.array, cache: List, root_position: int) -> Tuple[DraftTree, mx.array]:
        committed = cache[0].offset
        if self.compiled is not None and cache[0].keys is not None:
            reserve(cache, self.slots)  # the tree's entries go past the committed ones, in place
            tokens, cache[0].keys, cache[0].values = self.compiled(
                root_hidden, cache[0].keys, cache[0].values, mx.array(committed), mx.array(root_position))
        else:
            tokens = self._static_tokens(root_hidden, lambda level, depth, hidden, expanded, slots: self.head.step(
                self.target, hidden, expanded, cache, root_position + depth,
                None if level.ancestors is None else tree_mask(committed, level.ancestors)))[0]
        return self._shape(), tokens

    def _shape(self) -> DraftTree:
        """The static tree's shape (its tokens on the device)."""
        return DraftTree([], list(self.shape.parents), list(self.shape.depths))

    def _static_graph(self, root_hidden: mx.array, keys: mx.array, values: mx.array, committed: mx.array,
                      root_position: mx.array) -> Tuple[mx.array, mx.array, mx.array]:
        """``_static`` over the head cache's buffer ``keys``/``values`` (of which the first
        ``committed`` entries are), as one function of arrays: what ``compiled`` traces.
        Returns the tokens and the buffers, the tree's entries written past the committed."""
        buffered = Buffered(keys, values, committed)
        tokens = self._static_tokens(root_hidden, lambda level, depth, hidden, expanded, slots: self.head.step(
            self.target, hidden, expanded, [buffered], root_position + depth,
            cached_mask(keys.shape[2], committed, level.ancestors, slots, expanded.shape[1])))[0]
        return tokens, buffered.keys, buffered.values

    def _static_tokens(self, root_hidden: mx.array, step: Callable) -> mx.array:
        """The static tree's tokens after each of ``root_hidden``'s rows (the head's output at
        a conversation's root, [rows, H]), drafted depth by depth: each depth's tokens
        gathered from the top ids of the depth above, and the head run on those with
        children, ``step(level, depth, hidden, tokens, slots)`` over [1, rows x n] of them
        (each row's n together), appending their entries to the rows' caches (``slots``:
        each row's tree entries so far, these included). Returns the tokens [rows, nodes]."""
        rows = root_hidden.shape[0]
        outputs, tokens, slots = root_hidden, [], 0
        top = self.top_ids(outputs, self.ranks).reshape(rows, -1)
        for depth, level in enumerate(self.levels, start=1):
            tokens.append(_take(top, level.picks))
            if not level.grows:
                break
            hidden = _take(outputs.reshape(rows, -1, outputs.shape[-1]), level.parent_rows)
            expanded = _take(tokens[-1], level.expand)
            slots += expanded.shape[1]
            outputs = step(level, depth, hidden.reshape(1, -1, hidden.shape[-1]), expanded.reshape(1, -1), slots)[0]
            top = self.top_ids(outputs, self.ranks).reshape(rows, -1)
        return mx.concatenate(tokens, axis=1).astype(mx.int32)

    def drafts_rows(self) -> bool:
        """Whether ``read_and_draft_rows`` drafts for this tree: a static one, drafted where
        rounds are not compiled (a compiled call per row replays a traced graph instead)."""
        return self.spec.kind == "static" and self.compiled is None

    def read_and_draft_rows(self, reads: Sequence[Tuple[mx.array, mx.array, List]]) -> List[Tuple[DraftTree, mx.array]]:
        """``read_and_draft`` for several conversations at once, each read ``(features,
        tokens, cache)`` its own (at least one token): one head pass reads every
        conversation's committed tokens and one a depth grows all their trees, the tokens
        packed into one sequence and each conversation attending over its own cache
        (target.PackedCache). A conversation's tree is the one it drafts alone, but for the
        last bits of products over more rows. Where ``drafts_rows``."""
        caches = [cache[0] for _, _, cache in reads]
        committed = [cache.offset for cache in caches]
        sizes = [tokens.size for _, tokens, _ in reads]
        cuts = cuts_of(sizes)
        positions = mx.concatenate([mx.arange(start, start + size) for start, size in zip(committed, sizes)])
        read = PackedCache(caches, cuts, ["causal" if size > 1 else None for size in sizes])
        out = self.head.step(self.target, self.head.project(mx.concatenate([f for f, _, _ in reads]))[None],
                             mx.concatenate([t for _, t, _ in reads])[None], [read], positions, None)[0]
        roots = out[mx.array(cuts[1:]) - 1]
        after = [cache.offset for cache in caches]
        root_positions = mx.array(after) - 1

        def step(level: _Level, depth: int, hidden: mx.array, expanded: mx.array, slots: int) -> mx.array:
            each = expanded.shape[1] // len(reads)
            masks = [None if level.ancestors is None else tree_mask(start, level.ancestors) for start in after]
            packed = PackedCache(caches, cuts_of([each] * len(reads)), masks)
            positions = mx.repeat(root_positions + depth, each)
            return self.head.step(self.target, hidden, expanded, [packed], positions, None)

        try:
            tokens = self._static_tokens(roots, step)
        finally:
            for (_, _, cache), start in zip(reads, after):
                keep_cache_entries(cache, start, [])
        return [(self._shape(), tokens[row]) for row in range(len(reads))]

    def _dynamic(self, growth: "_Growth") -> DraftTree:
        """EAGLE-2: expand the k best nodes of each depth by cumulative draft
        log-probability, then keep the best ``tokens`` nodes of all drafted."""
        spec, pool = self.spec, growth.tree
        scores: List[float] = []
        ids, logprobs = self.top(growth.root_hidden, spec.topk)
        layer = [pool.add(int(t), -1) for t in ids[0]]
        scores += [float(s) for s in logprobs[0]]
        for _ in range(spec.depth - 1):
            expand = sorted(layer, key=lambda n: -scores[n])[: spec.topk]
            ids, logprobs = growth.expand(expand)
            layer = []
            for row, node in enumerate(expand):
                for token, logprob in zip(ids[row], logprobs[row]):
                    layer.append(pool.add(int(token), node))
                    scores.append(scores[node] + float(logprob))
        # A child never outscores its parent and is deeper, so every prefix of
        # this order holds each kept node's parent.
        best = sorted(range(len(pool)), key=lambda n: (-scores[n], pool.depths[n]))[: spec.tokens]
        return pool.subtree(sorted(best, key=lambda n: (pool.depths[n], -scores[n])))


class _Growth:
    """One round's tree while it grows: its nodes, and the draft output and cache
    slot of each node already run through the head."""

    def __init__(self, drafter: TreeDrafter, root_hidden: mx.array, cache: List, root_position: int):
        self.drafter, self.root_hidden, self.cache, self.root_position = drafter, root_hidden, cache, root_position
        self.committed = cache[0].offset
        self.tree = DraftTree()
        self.outputs: Dict[int, mx.array] = {-1: root_hidden[0]}
        self.slots: Dict[int, int] = {}
        self.compiled = drafter.compiled_expand is not None and cache[0].keys is not None
        if self.compiled:  # every depth's entries go past the committed ones, in place
            reserve(cache, drafter.spec.topk * drafter.spec.depth)

    def expand(self, nodes: List[int]) -> Tuple[np.ndarray, np.ndarray]:
        """Run the head on ``nodes`` (all of one depth); returns the top-k (target ids,
        log-probabilities) of its draft after each, read to the host."""
        tree, spec = self.tree, self.drafter.spec
        ancestors = np.zeros((len(nodes), len(self.slots) + len(nodes)), dtype=bool)
        for row, node in enumerate(nodes):
            ancestors[row, len(self.slots) + row] = True
            parent = tree.parents[node]
            while parent >= 0:
                ancestors[row, self.slots[parent]] = True
                parent = tree.parents[parent]
        hidden = mx.stack([self.outputs[tree.parents[n]] for n in nodes])[None]
        tokens = mx.array([[tree.tokens[n] for n in nodes]])
        position = self.root_position + tree.depths[nodes[0]]
        if self.compiled:
            layer_cache = self.cache[0]
            out, ids, logprobs, layer_cache.keys, layer_cache.values = self.drafter.compiled_expand(
                hidden, tokens, layer_cache.keys, layer_cache.values, mx.array(self.committed),
                mx.array(self.committed + len(self.slots)), mx.array(position), mx.array(ancestors))
            top = _read(ids, logprobs)
        else:
            out = self.drafter.head.step(self.drafter.target, hidden, tokens, self.cache, position,
                                         tree_mask(self.committed, mx.array(ancestors)))[0]
            top = self.drafter.top(out, spec.topk)
        for row, node in enumerate(nodes):
            self.slots[node] = len(self.slots)
            self.outputs[node] = out[row]
        return top


def _read(ids: mx.array, logprobs: mx.array) -> Tuple[np.ndarray, np.ndarray]:
    """Top-k ids and log-probabilities, read to the host together."""
    mx.eval(ids, logprobs)
    return np.array(ids), np.array(logprobs)
