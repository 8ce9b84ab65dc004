"""EAGLE heads as a drafter: the head's tree for the next round is grown as soon as the
target commits tokens, queued on the device while the host streams them.

A node is fed to the head as (its parent's draft output, its own token) at position
root + depth; it attends to the committed draft cache and its own ancestors, and the
tree's draft KV entries are dropped once the tree is grown. The head's cache keeps only
committed tokens: each round it reads the accepted tokens with the target's fresh states.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache

from ..errors import UserError
from ..heads import FAMILIES, Head, load_head
from ..target import check_target, keep_cache_entries, tree_mask
from ..trees import DraftTree, RankPath, TreeSpec
from . import Budget, Drafter, DraftSettings, DraftSource, Outcome, Proposal

NAME = "eagle"


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
    indices fixed per shape. A dynamic tree (EAGLE-2) chooses what to expand by score,
    reading each depth's top ids once.
    """

    def __init__(self, head, target, spec: TreeSpec):
        self.head, self.target, self.spec = head, target, spec
        if spec.kind == "static":
            paths = sorted(spec.paths, key=lambda p: (len(p), p))
            self.ranks = max(max(p) for p in paths) + 1
            self.shape, self.levels = _static_levels(paths, self.ranks)
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
        logits = self.head.logits(self.target, hidden).astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        k = min(k, logprobs.shape[-1])
        draft_ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[..., :k]
        top_logprobs = mx.take_along_axis(logprobs, draft_ids, axis=-1)
        order = mx.argsort(-top_logprobs, axis=-1)
        ids = self.head.target_ids(mx.take_along_axis(draft_ids, order, axis=-1))
        top_logprobs = mx.take_along_axis(top_logprobs, order, axis=-1)
        mx.eval(ids, top_logprobs)
        return np.array(ids), np.array(top_logprobs)

    def _static(self, root_hidden: mx.array, cache: List, root_position: int) -> Tuple[DraftTree, mx.array]:
        committed = cache[0].offset
        outputs, tokens = root_hidden, []
        top = self.top_ids(outputs, self.ranks)
        for depth, level in enumerate(self.levels, start=1):
            tokens.append(_take(top.reshape(-1), level.picks))
            if not level.grows:
                break
            hidden = _take(outputs, level.parent_rows)[None]
            mask = None if level.ancestors is None else tree_mask(committed, level.ancestors)
            outputs = self.head.step(self.target, hidden, _take(tokens[-1], level.expand)[None], cache,
                                     root_position + depth, mask)[0]
            top = self.top_ids(outputs, self.ranks)
        shape = self.shape
        return DraftTree([], list(shape.parents), list(shape.depths)), mx.concatenate(tokens).astype(mx.int32)

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


class EagleDrafter(Drafter):
    """An EAGLE head (EAGLE-1/2/3, or any object with the ``Head`` interface) drafting a
    ``tree`` each round."""

    def __init__(self, head: Head, target: nn.Module, tree: TreeSpec):
        check_target(target)
        self.head, self.target = head, target
        self.taps = tuple(head.taps(target.args.num_hidden_layers) or ())
        self.grower = TreeDrafter(head, target, tree)
        self.cache = [KVCache()]  # the head's, for committed tokens only
        self.queued: Optional[Proposal] = None  # the next round's tree, grown on the device

    def reusable(self, common: int) -> int:
        # The head's entry at t pairs feature t with token t + 1: still good only where
        # token t + 1 is shared too.
        return min(self.cache[0].offset, max(common - 1, 0))

    def observe(self, outcome: Outcome) -> None:
        """Read the committed (feature, next token) pairs and grow the next round's tree,
        queued on the device; its tokens stay there."""
        keep_cache_entries(self.cache, outcome.start, [])
        tokens = mx.array(outcome.new_tokens)
        features = outcome.states.read(self.taps)
        out = self.head.step(self.target, self.head.project(features)[None], tokens[None], self.cache,
                             self.cache[0].offset, "causal" if tokens.size > 1 else None)
        tree, tree_tokens = self.grower.draft(out[:, -1], self.cache, self.cache[0].offset - 1)
        mx.async_eval(tree_tokens)
        self.queued = Proposal(tree, tree_tokens)

    def propose(self, budget: Budget) -> Optional[Proposal]:
        proposal, self.queued = self.queued, None
        if proposal is None or max(proposal.tree.depths, default=0) <= budget.room:
            return proposal
        tree = proposal.tree.shallower(budget.room)  # near the end of the reply or the context
        return Proposal(tree, proposal.tokens[:len(tree)])


def recognizes(directory: Path, config: dict) -> bool:
    """An EAGLE head directory: one layer, as every EAGLE format has, or our own marks."""
    architectures = config.get("architectures") or []
    return (config.get("family") in FAMILIES or "draft_vocab_size" in config
            or any(isinstance(a, str) and "eagle" in a.lower() for a in architectures)
            or config.get("num_hidden_layers") == 1)


def load(directory: Path, model: nn.Module) -> Head:
    return load_head(directory, model)


def accepts(draft: object) -> bool:
    return all(callable(getattr(draft, name, None)) for name in ("taps", "project", "step", "logits", "target_ids"))


def shipped(model: nn.Module) -> Optional[Head]:
    """The head shipped in this package for ``model``, if any."""
    from ..models import shipped_head_dir

    found = shipped_head_dir(model)
    return load_head(found, model) if found is not None else None


def source(head: Head, model: nn.Module, settings: DraftSettings) -> DraftSource:
    """The head drafting the tree ``settings.tree`` names (``auto``: tuned or calibrated for
    this device; none where it is expected to lose)."""
    from ..calibrate import auto_tree
    from ..trees import parse_tree

    tree, why = settings.tree, None
    if tree is None or tree == "auto":
        tree, why = auto_tree(model, head)
    elif isinstance(tree, str):
        tree = parse_tree(tree)
    family = getattr(head, "family", "draft")
    if tree.kind == "none":
        return DraftSource(f"{family} head", None, why or "tree none")
    return DraftSource(f"{family} head, tree {tree.text}", lambda: EagleDrafter(head, model, tree), why, head)
