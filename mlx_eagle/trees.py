"""Draft trees: their shapes (``--tree`` specs), and how a head grows one each round.

A tree's nodes are the draft tokens after the root, the token the target already
chose. Nodes come parents first; ``parents[i]`` is -1 for children of the root.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .errors import UserError, did_you_mean
from .target import COMPILED_TOKENS, Buffered, compiled_rounds, drives, held_mask, keep_cache_entries, reserve, \
    tree_mask

RankPath = Tuple[int, ...]

# Small, for single-user decoding where verifying many tokens costs: 12 nodes, depth 5.
DEFAULT_STATIC: List[RankPath] = [
    (0,), (1,), (2,),
    (0, 0), (0, 1), (1, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0),
    (0, 0, 0, 0), (0, 0, 0, 1),
    (0, 0, 0, 0, 0),
]


@dataclass
class TreeSpec:
    """``chain:K``, ``static:default``, ``static:FILE``, ``dynamic:topk=8,depth=5,tokens=32``
    or ``none`` (plain decoding)."""

    kind: str  # "none" | "static" | "dynamic"
    paths: List[RankPath] = field(default_factory=list)
    topk: int = 8
    depth: int = 5
    tokens: int = 32
    text: str = "none"

    @property
    def max_nodes(self) -> int:
        return self.tokens if self.kind == "dynamic" else len(self.paths)


def chain_of(spec: TreeSpec) -> TreeSpec:
    """What a target that verifies chains only (the hybrid families) can draft of ``spec``:
    a chain as deep as the tree, each depth's best token."""
    if spec.kind == "none" or (spec.kind == "static" and spec.paths == chain(len(spec.paths))):
        return spec
    depth = spec.depth if spec.kind == "dynamic" else max(len(path) for path in spec.paths)
    return TreeSpec("static", chain(depth), text=f"chain:{depth} (of {spec.text}: this model verifies chains)")


def node_count(count: int) -> str:
    return f"{count} node{'' if count == 1 else 's'}"


def chain(length: int) -> List[RankPath]:
    return [(0,) * depth for depth in range(1, length + 1)]


# A tree is verified in one forward pass each round: more nodes than this cost far more
# than they could save, and a file asking for them is a mistake (or an attack).
MAX_TREE_NODES = 256
MAX_TREE_FILE_BYTES = 1 << 20
# A node's rank among its parent's drafts: a draft's 64th choice is never worth verifying,
# and a rank past the draft vocabulary cannot be drafted at all.
MAX_RANK = 63


def check_paths(paths: object, source: str) -> List[RankPath]:
    """Rank paths from a tree file or a tuned tree: non-empty lists of integers from 0 to
    MAX_RANK, each path's parent present, at most MAX_TREE_NODES of them."""
    example = f"give a list of rank paths, lists of integers from 0 to {MAX_RANK}, e.g. [[0], [1], [0, 0]]"
    if not isinstance(paths, (list, tuple)) or not paths or \
            any(not isinstance(p, (list, tuple)) or not p for p in paths):
        raise UserError(f"tree {source}: {example}")
    if len(paths) > MAX_TREE_NODES or any(len(p) > MAX_TREE_NODES for p in paths):
        raise UserError(f"tree {source}: more than {MAX_TREE_NODES} nodes; a tree holds at most {MAX_TREE_NODES}")
    if any(type(r) is not int or not 0 <= r <= MAX_RANK for p in paths for r in p):
        raise UserError(f"tree {source}: {example}")
    result = [tuple(p) for p in paths]
    known = set(result)
    if len(known) != len(result):
        raise UserError(f"tree {source}: a rank path appears twice")
    missing = [p for p in result if len(p) > 1 and p[:-1] not in known]
    if missing:
        raise UserError(f"tree {source}: path {list(missing[0])} has no parent {list(missing[0][:-1])}")
    return sorted(result, key=lambda p: (len(p), p))


def read_tree_file(name: str) -> List[RankPath]:
    """A static tree from a file: JSON (or a Python literal) holding rank paths, or an
    object with "paths" (as tune writes them)."""
    path = Path(name).expanduser()
    if not path.exists():
        raise UserError(f"tree file {name} does not exist")
    if not path.is_file():
        raise UserError(f"tree file {name} is not a regular file; pass a JSON file of rank paths")
    try:
        with path.open("rb") as file:
            data = file.read(MAX_TREE_FILE_BYTES + 1)
    except OSError as exc:
        raise UserError(f"tree file {name} cannot be read ({exc.strerror})") from None
    if len(data) > MAX_TREE_FILE_BYTES:
        raise UserError(f"tree file {name} is over {MAX_TREE_FILE_BYTES >> 20} MiB; a tree file is a short JSON list")
    try:
        text = data.decode("utf-8")
        try:
            paths = json.loads(text)
        except ValueError:
            paths = ast.literal_eval(text)
    except (ValueError, SyntaxError, RecursionError, MemoryError, TypeError) as exc:
        raise UserError(f"tree file {name} is not JSON rank paths ({type(exc).__name__}); "
                        "give e.g. [[0], [1], [0, 0]]") from None
    if isinstance(paths, dict):
        paths = paths.get("paths", [])
    return check_paths(paths, name)


def parse_tree(spec: str) -> TreeSpec:
    """Parse a ``--tree`` value into a TreeSpec, with one clear line when it is wrong."""
    kind, _, arg = spec.partition(":")
    usage = "use chain:K, static:default, static:FILE, dynamic:topk=K,depth=D,tokens=N or none"
    try:
        if kind == "none" and not arg:
            return TreeSpec("none", text=spec)
        if kind == "chain":
            length = int(arg)
            if not 1 <= length <= 64:
                raise UserError(f"tree {spec!r}: a chain holds 1 to 64 tokens")
            return TreeSpec("static", chain(length), text=spec)
        if kind == "static":
            if arg in ("", "default"):
                return TreeSpec("static", list(DEFAULT_STATIC), text=spec)
            return TreeSpec("static", read_tree_file(arg), text=spec)
        if kind == "dynamic":
            values = dict(item.split("=", 1) for item in arg.split(",") if item) if arg else {}
            unknown = set(values) - {"topk", "depth", "tokens"}
            if unknown:
                raise UserError(f"tree {spec!r}: unknown setting {sorted(unknown)[0]!r}; {usage}")
            tree = TreeSpec("dynamic", text=spec, **{k: int(v) for k, v in values.items()})
            if not (1 <= tree.topk <= 64 and 1 <= tree.depth <= 32 and 1 <= tree.tokens <= 256):
                raise UserError(f"tree {spec!r}: need 1<=topk<=64, 1<=depth<=32, 1<=tokens<=256")
            return tree
    except UserError:
        raise
    except (ValueError, SyntaxError) as exc:
        raise UserError(f"malformed tree {spec!r} ({exc}); {usage}") from None
    hint = did_you_mean(kind, ("auto", "chain", "static", "dynamic", "none"))
    raise UserError(f"malformed tree {spec!r}{hint}; {usage}")


@dataclass
class DraftTree:
    """A drafted tree. ``tokens`` are target ids; a tree drafted on the device comes
    with them still there (see drafters.Proposal) and ``tokens`` empty until read."""

    tokens: List[int] = field(default_factory=list)  # target ids
    parents: List[int] = field(default_factory=list)  # index into nodes, -1 = root
    depths: List[int] = field(default_factory=list)  # 1 for the root's children

    def __len__(self) -> int:
        return len(self.parents)

    def children(self) -> Dict[int, List[int]]:
        """Node index (-1: root) -> its children's indices, in draft rank order."""
        result: Dict[int, List[int]] = {}
        for index, parent in enumerate(self.parents):
            result.setdefault(parent, []).append(index)
        return result

    def ancestor_matrix(self) -> mx.array:
        """[1 + n, 1 + n] bool, root first: True where row may attend to column."""
        return mx.array(self.ancestors())

    def ancestors(self) -> np.ndarray:
        """ancestor_matrix on the host."""
        return ancestors(tuple(self.parents))

    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self) - 1))

    def add(self, token: int, parent: int) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        return len(self.tokens) - 1

    def graft(self, chain: Sequence[int]) -> List[int]:
        """Add ``chain`` as a branch from the root (see ``merge``); returns its nodes."""
        return self.merge(DraftTree([], list(range(-1, len(chain) - 1)), list(range(1, len(chain) + 1))), chain)

    def merge(self, other: "DraftTree", tokens: Sequence[int]) -> List[int]:
        """Add ``other`` (a tree after the same root, holding ``tokens``), following nodes
        that already hold its tokens so that no token is verified twice; returns where
        each of its nodes now is."""
        children = self.children()
        placed: List[int] = []
        for token, parent in zip(tokens, other.parents):
            at = placed[parent] if parent >= 0 else -1
            match = next((c for c in children.get(at, []) if self.tokens[c] == token), None)
            if match is None:
                match = self.add(int(token), at)
                children.setdefault(at, []).append(match)
            placed.append(match)
        return placed

    def subtree(self, kept: List[int]) -> "DraftTree":
        """The nodes ``kept`` (parents before children), renumbered."""
        index = {old: new for new, old in enumerate(kept)}
        result = DraftTree()
        for old in kept:
            parent = self.parents[old]
            result.add(self.tokens[old], -1 if parent < 0 else index[parent])
        return result

    def shallower(self, depth: int) -> "DraftTree":
        """The nodes no deeper than ``depth``: a prefix, as nodes come shallowest first."""
        count = sum(1 for d in self.depths if d <= depth)
        return DraftTree(self.tokens[:count], self.parents[:count], self.depths[:count])


@lru_cache(maxsize=256)
def ancestors(parents: Tuple[int, ...]) -> np.ndarray:
    """A tree's [1 + n, 1 + n] attention pattern (see DraftTree.ancestor_matrix), kept
    per shape: a static tree's is the same every round (read only)."""
    matrix = np.eye(len(parents) + 1, dtype=bool)
    matrix[:, 0] = True
    for index, parent in enumerate(parents):
        if parent >= 0:
            matrix[index + 1] |= matrix[parent + 1]
    matrix.flags.writeable = False
    return matrix


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
    return values if indices is None else values[indices]


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
    (``read_and_draft``): the head's cache enters as its preallocated buffer (target.Buffered)
    and a count of the entries that are committed, so the call's shapes change only when
    the buffer grows, and the host replays one traced graph instead of building one depth
    by depth in Python. A dynamic tree (EAGLE-2) chooses what to expand by score, reading
    each depth's top ids once; with such a head each depth is one compiled call.
    """

    def __init__(self, head, target, spec: TreeSpec, compiled: Optional[bool] = None):
        """``compiled``: draft in compiled calls where the head allows it (None: where
        target.compiled_rounds says; tests compare both)."""
        self.head, self.target, self.spec = head, target, spec
        self.compiled = self.compiled_expand = None
        compiling = (compiled_rounds() if compiled is None else compiled) and getattr(head, "traceable", False) \
            and drives(target)
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
        return DraftTree([], list(self.shape.parents), list(self.shape.depths)), tree_tokens

    def _read_and_draft_graph(self, features: mx.array, tokens: mx.array, keys: mx.array, values: mx.array,
                              committed: mx.array) -> Tuple[mx.array, mx.array, mx.array]:
        """``read_and_draft`` as one function of arrays: what ``compiled_read`` traces."""
        count = tokens.shape[0]
        buffered = Buffered(keys, values, committed)
        out = self.head.step(self.target, self.head.project(features)[None], tokens[None], [buffered],
                             committed + mx.arange(count), held_mask(keys.shape[2], committed, None, count, count))
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
        mask = held_mask(keys.shape[2], committed, ancestors, ancestors.shape[1], ancestors.shape[0])
        out = self.head.step(self.target, hidden, tokens, [buffered], position, mask)[0]
        return (out, *self._top_graph(out, self.spec.topk), buffered.keys, buffered.values)

    def _static(self, root_hidden: mx.array, cache: List, root_position: int) -> Tuple[DraftTree, mx.array]:
        committed = cache[0].offset
        if self.compiled is not None and cache[0].keys is not None:
            reserve(cache, self.slots)  # the tree's entries go past the committed ones, in place
            tokens, cache[0].keys, cache[0].values = self.compiled(
                root_hidden, cache[0].keys, cache[0].values, mx.array(committed), mx.array(root_position))
        else:
            tokens = self._static_tokens(root_hidden, cache, root_position, lambda level, rows, slots: None
                                         if level.ancestors is None else tree_mask(committed, level.ancestors))
        return DraftTree([], list(self.shape.parents), list(self.shape.depths)), tokens

    def _static_graph(self, root_hidden: mx.array, keys: mx.array, values: mx.array, committed: mx.array,
                      root_position: mx.array) -> Tuple[mx.array, mx.array, mx.array]:
        """``_static`` over the head cache's buffer ``keys``/``values`` (of which the first
        ``committed`` entries are), as one function of arrays: what ``compiled`` traces.
        Returns the tokens and the buffers, the tree's entries written past the committed."""
        buffered = Buffered(keys, values, committed)
        tokens = self._static_tokens(root_hidden, [buffered], root_position, lambda level, rows, slots: held_mask(
            keys.shape[2], committed, level.ancestors, slots, rows))
        return tokens, buffered.keys, buffered.values

    def _static_tokens(self, root_hidden: mx.array, cache: List, root_position, mask_of: Callable) -> mx.array:
        """The static tree's tokens, drafted depth by depth: each depth's tokens gathered from
        the top ids of the depth above, the head run on those with children into ``cache``
        under ``mask_of(level, rows, slots)`` (``slots``: the tree's entries so far, this
        depth's included)."""
        outputs, tokens, slots = root_hidden, [], 0
        top = self.top_ids(outputs, self.ranks)
        for depth, level in enumerate(self.levels, start=1):
            tokens.append(_take(top.reshape(-1), level.picks))
            if not level.grows:
                break
            hidden = _take(outputs, level.parent_rows)[None]
            expanded = _take(tokens[-1], level.expand)
            slots += expanded.shape[0]
            outputs = self.head.step(self.target, hidden, expanded[None], cache, root_position + depth,
                                     mask_of(level, expanded.shape[0], slots))[0]
            top = self.top_ids(outputs, self.ranks)
        return mx.concatenate(tokens).astype(mx.int32)

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
