"""Draft trees as data: their shapes (``--tree`` specs, their parser and tree files) and
``DraftTree``, what a drafter proposes. Pure: how a head grows a tree each round lives
with the EAGLE drafter (drafters/eagle.py).

A tree's nodes are the draft tokens after the root, the token the target already
chose. Nodes come parents first; ``parents[i]`` is -1 for children of the root.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .errors import UserError, did_you_mean
from .files import parse_json, read_limited

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

    @property
    def max_depth(self) -> int:
        return self.depth if self.kind == "dynamic" else max((len(path) for path in self.paths), default=0)


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
    try:
        data = read_limited(path, MAX_TREE_FILE_BYTES)
    except ValueError as exc:
        raise UserError(f"tree file {name}: {exc}; pass a JSON file of rank paths (a short list)") from None
    try:
        paths = parse_json(data)
    except ValueError as not_json:
        try:  # EAGLE's published trees are Python lists, written as such
            paths = ast.literal_eval(data.decode("utf-8"))
        except (ValueError, SyntaxError, RecursionError, MemoryError, TypeError):
            raise UserError(f"tree file {name} holds no rank paths: {not_json}; give e.g. [[0], [1], [0, 0]]") from None
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
        """The nodes ``kept`` (parents before children), renumbered; without tokens where
        the tree holds none on the host."""
        index = {old: new for new, old in enumerate(kept)}
        parents = [index[self.parents[old]] if self.parents[old] >= 0 else -1 for old in kept]
        depths = [self.depths[old] for old in kept]
        return DraftTree([self.tokens[old] for old in kept] if self.tokens else [], parents, depths)

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
