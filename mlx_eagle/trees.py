"""Draft trees: their shapes (``--tree`` specs) and how the head grows one each round.

A tree's nodes are the draft tokens after the root, the token the target already
chose. Nodes come parents first; ``parents[i]`` is -1 for children of the root.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .cli import UserError
from .target import keep_cache_entries, tree_mask

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


def chain(length: int) -> List[RankPath]:
    return [(0,) * depth for depth in range(1, length + 1)]


def check_paths(paths: Sequence[Sequence[int]], source: str) -> List[RankPath]:
    result = [tuple(int(r) for r in p) for p in paths]
    if not result or any(not p or min(p) < 0 for p in result):
        raise UserError(f"tree {source}: give non-empty rank paths of non-negative integers, e.g. [[0], [1], [0, 0]]")
    known = set(result)
    if len(known) != len(result):
        raise UserError(f"tree {source}: a rank path appears twice")
    missing = [p for p in result if len(p) > 1 and p[:-1] not in known]
    if missing:
        raise UserError(f"tree {source}: path {list(missing[0])} has no parent {list(missing[0][:-1])}")
    return sorted(result, key=lambda p: (len(p), p))


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
            path = Path(arg).expanduser()
            if not path.exists():
                raise UserError(f"tree file {arg} does not exist")
            text = path.read_text()
            try:
                paths = json.loads(text)
            except ValueError:
                paths = ast.literal_eval(text)
            if isinstance(paths, dict):
                paths = paths.get("paths", [])
            return TreeSpec("static", check_paths(paths, arg), text=spec)
        if kind == "dynamic":
            values = dict(item.split("=", 1) for item in arg.split(",") if item) if arg else {}
            unknown = set(values) - {"topk", "depth", "tokens"}
            if unknown:
                raise UserError(f"tree {spec!r}: unknown setting {sorted(unknown)[0]!r}; {usage}")
            tree = TreeSpec("dynamic", text=spec, **{k: int(v) for k, v in values.items()})
            if not (1 <= tree.topk <= 64 and 1 <= tree.depth <= 32 and 1 <= tree.tokens <= 256):
                raise UserError(f"tree {spec!r}: need 1<=topk<=64, 1<=depth<=32, 1<=tokens<=256")
            return tree
    except (ValueError, SyntaxError) as exc:
        raise UserError(f"malformed tree {spec!r} ({exc}); {usage}") from None
    raise UserError(f"malformed tree {spec!r}; {usage}")


@dataclass
class DraftTree:
    tokens: List[int] = field(default_factory=list)  # target ids
    parents: List[int] = field(default_factory=list)  # index into nodes, -1 = root
    depths: List[int] = field(default_factory=list)  # 1 for the root's children

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self) -> Dict[int, List[int]]:
        """Node index (-1: root) -> its children's indices, in draft rank order."""
        result: Dict[int, List[int]] = {}
        for index, parent in enumerate(self.parents):
            result.setdefault(parent, []).append(index)
        return result

    def ancestor_matrix(self) -> np.ndarray:
        """[1 + n, 1 + n] bool, root first: True where row may attend to column."""
        size = len(self) + 1
        matrix = np.eye(size, dtype=bool)
        matrix[:, 0] = True
        for index, parent in enumerate(self.parents):
            row = index + 1
            if parent >= 0:
                matrix[row] |= matrix[parent + 1]
        return matrix

    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self) - 1))

    def add(self, token: int, parent: int) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        return len(self.tokens) - 1

    def graft(self, chain: Sequence[int]) -> List[int]:
        """Add ``chain`` as a branch from the root, following nodes that already hold its
        tokens so that no token is verified twice; returns the chain's nodes."""
        children = self.children()
        nodes, node = [], -1
        for token in chain:
            match = next((c for c in children.get(node, []) if self.tokens[c] == token), None)
            node = match if match is not None else self.add(token, node)
            nodes.append(node)
        return nodes

    def subtree(self, kept: List[int]) -> "DraftTree":
        """The nodes ``kept`` (parents before children), renumbered."""
        index = {old: new for new, old in enumerate(kept)}
        result = DraftTree()
        for old in kept:
            parent = self.parents[old]
            result.add(self.tokens[old], -1 if parent < 0 else index[parent])
        return result


class TreeDrafter:
    """Grows a draft tree with the head, one batched draft step per depth.

    A node is fed to the head as (its parent's draft output, its own token) at
    position root + depth; it attends to the committed draft cache and its own
    ancestors. The tree's draft KV entries are dropped once the tree is grown.
    """

    def __init__(self, head, target, spec: TreeSpec):
        self.head, self.target, self.spec = head, target, spec
        self._children_ranks: Dict[RankPath, List[int]] = {}
        for path in spec.paths:
            self._children_ranks.setdefault(path[:-1], []).append(path[-1])

    def draft(self, root_hidden: mx.array, cache: List, root_position: int) -> DraftTree:
        """``root_hidden`` [1, H]: the head's output at the root; ``cache``: the
        committed draft cache (left as it was); ``root_position``: the root's position."""
        committed = cache[0].offset
        grow = self._dynamic if self.spec.kind == "dynamic" else self._static
        try:
            return grow(_Growth(self, root_hidden, cache, root_position))
        finally:
            keep_cache_entries(cache, committed, [])

    def top(self, hidden: mx.array, k: int) -> Tuple[np.ndarray, np.ndarray]:
        """Top-k (target ids, log-probabilities) of the draft for each row of ``hidden``."""
        logits = self.head.logits(self.target, hidden).astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        k = min(k, logprobs.shape[-1])
        draft_ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[..., :k]
        top_logprobs = mx.take_along_axis(logprobs, draft_ids, axis=-1)
        order = mx.argsort(-top_logprobs, axis=-1)
        draft_ids = mx.take_along_axis(draft_ids, order, axis=-1)
        ids = self.head.target_ids(draft_ids)
        return np.array(ids), np.array(mx.take_along_axis(top_logprobs, order, axis=-1))

    def _static(self, growth: "_Growth") -> DraftTree:
        tree = growth.tree
        max_rank = max(max(p) for p in self.spec.paths) + 1
        path_of: Dict[int, RankPath] = {-1: ()}
        ids, _ = self.top(growth.root_hidden, max_rank)
        frontier = {-1: ids[0]}  # node -> the draft's top ids after it
        while frontier:
            added = []
            for node, top_ids in frontier.items():
                for rank in self._children_ranks.get(path_of[node], []):
                    child = tree.add(int(top_ids[rank]), node)
                    path_of[child] = path_of[node] + (rank,)
                    added.append(child)
            expand = [n for n in added if path_of[n] in self._children_ranks]
            if not expand:
                break
            ids, _ = self.top(growth.expand(expand), max_rank)
            frontier = dict(zip(expand, ids))
        return tree

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
            ids, logprobs = self.top(growth.expand(expand), spec.topk)
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

    def expand(self, nodes: List[int]) -> mx.array:
        """Run the head on ``nodes`` (all of one depth); returns their outputs [len, H]."""
        tree = self.tree
        ancestors = np.zeros((len(nodes), len(self.slots) + len(nodes)), dtype=bool)
        for row, node in enumerate(nodes):
            ancestors[row, len(self.slots) + row] = True
            parent = tree.parents[node]
            while parent >= 0:
                ancestors[row, self.slots[parent]] = True
                parent = tree.parents[parent]
        hidden = mx.stack([self.outputs[tree.parents[n]] for n in nodes])[None]
        tokens = mx.array([[tree.tokens[n] for n in nodes]])
        positions = self.root_position + tree.depths[nodes[0]]
        mask = tree_mask(self.committed, mx.array(ancestors))
        out = self.drafter.head.step(self.drafter.target, hidden, tokens, self.cache, positions, mask)[0]
        for row, node in enumerate(nodes):
            self.slots[node] = len(self.slots)
            self.outputs[node] = out[row]
        return out
