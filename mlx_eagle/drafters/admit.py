"""What a proposal must be before the target verifies it: the one check every drafter's
proposal passes where it enters a round. The verifier trusts only token ids and parent
links, so that no drafter, however it is written, can change the text.

``admit`` returns a proposal the verifier takes as it is:
- depths are derived from the parents (a drafter's own ``depths`` are never read);
- every parent comes before its child (-1: the root);
- the token array is 1-D, integer, one token per node (a list of ids, or none beside the
  tree's own ``tokens``, is made into one); where the tree also holds its tokens on the
  host (``tree.tokens``), they are the array's;
- host token ids lie inside the target's vocabulary, and duplicate siblings are merged,
  their subtrees too. Tokens still on the device (the built-in drafters keep them there,
  so that drafting overlaps the host's work) are checked on the device as the round
  accepts (verify.accept): an id outside the vocabulary is verified as token 0 and never
  accepted, and a sibling repeating an earlier one is never accepted, which keeps
  sampling exact;
- the budget, cut in this order: nodes deeper than ``budget.room`` (with their
  subtrees); then the nodes after the first ``budget.nodes`` kept, in the drafter's
  order (its best first); then, where the drafter gives each node a confidence, all but
  the most likely nodes: as many as give the most expected tokens for what verifying them
  costs on this device (their confidences kept, for the batch's choice: node_odds.py).
A proposal that breaks any rule but the budget is malformed: ``Malformed`` says why,
and the round goes on without it (``admit_or_warn``: one warning per drafter).
"""

from __future__ import annotations

import math
import sys
import weakref
from functools import lru_cache
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from ..trees import DraftTree
from . import Budget, Proposal

# A proposal is read no further than this many nodes: far past any budget (trees.MAX_TREE_NODES).
MAX_EXAMINED = 4096


class Malformed(ValueError):
    """A proposal the verifier cannot take; the message says what is wrong."""


def admit(proposal: object, budget: Budget) -> Optional[Proposal]:
    """``proposal`` as the verifier may take it (see the module's docstring), None for an
    empty one; raises Malformed."""
    if proposal is None:
        return None
    if not isinstance(proposal, Proposal) or not isinstance(proposal.tree, DraftTree):
        raise Malformed(f"propose returned {type(proposal).__name__}, not a Proposal (or None)")
    proposal = _first_nodes(proposal, MAX_EXAMINED)
    parents = _as_ints(proposal.tree.parents, "parents")
    tokens = proposal.tokens
    if tokens is None or isinstance(tokens, (list, tuple)) or _is_numpy_array(tokens):
        # token ids handed over on the host rather than as an array: the array made from them
        listed = _as_ints(proposal.tree.tokens if tokens is None else tokens, "tokens")
        proposal = Proposal(DraftTree(listed, proposal.tree.parents, []), mx.array(listed, dtype=mx.int64),
                            proposal.confidence)
        tokens = proposal.tokens
    if not isinstance(tokens, mx.array) or tokens.ndim != 1 or tokens.size != len(parents):
        shape = tuple(tokens.shape) if isinstance(tokens, mx.array) else type(tokens).__name__
        raise Malformed(f"its token array must be 1-D with one token per node ({len(parents)}), not {shape}")
    if not mx.issubdtype(tokens.dtype, mx.integer):
        raise Malformed(f"its token array holds {tokens.dtype}, not token ids")
    examined = min(len(parents), MAX_EXAMINED)
    host = _host_tokens(proposal, examined, budget.vocab)
    confidence = _confidence(proposal, len(parents))
    if host is None:
        kept, new_parents, depths = _shape(tuple(parents[:examined]), budget.room, budget.nodes)
        tree = DraftTree([], list(new_parents), list(depths))
        node_tokens = tokens.astype(mx.int32)
        if len(kept) != len(parents):
            node_tokens = node_tokens[mx.array(kept, dtype=mx.int32)] if kept else node_tokens[:0]
        scores = [confidence[old] for old in kept] if confidence is not None else None
    else:
        tree, scores = _merged(parents[:examined], host, confidence, budget)
        node_tokens = mx.array(tree.tokens, dtype=mx.int32)
    if scores is not None and budget.pricing is not None and len(tree):
        keep = _paying(tree, scores, budget)
        if len(keep) < len(tree):
            tree = tree.subtree(keep)
            node_tokens = node_tokens[mx.array(keep, dtype=mx.int32)] if keep else node_tokens[:0]
            scores = [scores[node] for node in keep]
    return Proposal(tree, node_tokens, scores) if len(tree) else None


_warned: "weakref.WeakSet" = weakref.WeakSet()
_warned_ids: set = set()  # drafters that cannot be weakly referenced


def admit_or_warn(drafter: object, proposal: object, budget: Budget, name: str = "") -> Optional[Proposal]:
    """``admit``, where a malformed proposal is dropped for this round with one warning
    per drafter (``name``: what to call it), never an error."""
    try:
        return admit(proposal, budget)
    except Malformed as problem:
        warn_once(drafter, f"drafter {name or type(drafter).__name__}: its proposal was dropped for this round: "
                           f"{problem}")
        return None


def warn_once(drafter: object, message: str) -> None:
    """``message`` on standard error, the first time only for ``drafter``."""
    try:
        if drafter in _warned:
            return
        _warned.add(drafter)
    except TypeError:
        if id(drafter) in _warned_ids:
            return
        _warned_ids.add(id(drafter))
    print(f"warning: {message} (said once per drafter)", file=sys.stderr)


def _as_ints(values: object, what: str) -> List[int]:
    try:
        items = list(values)  # type: ignore[call-overload]
    except TypeError:
        raise Malformed(f"its {what} are not a list") from None
    if not all(isinstance(v, int) and not isinstance(v, bool) or _is_numpy_int(v) for v in items):
        raise Malformed(f"its {what} must be whole numbers")
    return [int(v) for v in items]


def _is_numpy_array(value: object) -> bool:
    return type(value).__module__ == "numpy" and hasattr(value, "tolist") and hasattr(value, "ndim")


def _is_numpy_int(value: object) -> bool:
    return type(value).__module__ == "numpy" and hasattr(value, "dtype") and value.dtype.kind in "iu"


def _first_nodes(proposal: Proposal, count: int) -> Proposal:
    """``proposal`` cut to its first ``count`` nodes before any of it is read (parents come
    before their children, so they are a tree), so that a huge proposal costs no more than
    that; its parts' lengths are checked against each other first."""
    tree = proposal.tree
    try:
        nodes = len(tree.parents)
        parts = [(what, len(part)) for what, part in (("tree's tokens", tree.tokens), ("token list", proposal.tokens),
                                                       ("confidences", proposal.confidence))
                 if part is not None and not isinstance(part, mx.array) and len(part)]
    except TypeError:
        raise Malformed("its parents, tokens and confidences must be sequences") from None
    if nodes <= count:
        return proposal
    wrong = next(((what, length) for what, length in parts if length != nodes), None)
    if wrong is not None:
        raise Malformed(f"its {wrong[0]} hold {wrong[1]} entries for {nodes} nodes")
    tokens = proposal.tokens
    if tokens is not None and (not isinstance(tokens, mx.array) or (tokens.ndim == 1 and tokens.size == nodes)):
        tokens = tokens[:count]
    return Proposal(DraftTree(list(tree.tokens[:count]), list(tree.parents[:count]), []), tokens,
                    proposal.confidence[:count] if proposal.confidence is not None else None)


def _host_tokens(proposal: Proposal, examined: int, vocab: Optional[int]) -> Optional[List[int]]:
    """The tree's tokens on the host, checked against its array (None: only on the device)."""
    listed = proposal.tree.tokens
    if not listed:
        return None
    host = _as_ints(listed, "tokens")
    if len(host) != proposal.tokens.size:
        raise Malformed(f"its tree holds {len(host)} tokens for {proposal.tokens.size} nodes")
    host = host[:examined]
    if proposal.tokens[:examined].tolist() != host:
        raise Malformed("its tree's tokens differ from its token array")
    outside = next((t for t in host if not 0 <= t < (vocab or 1 << 62)), None)
    if outside is not None:
        raise Malformed(f"token id {outside} is outside the target's vocabulary (0 to {vocab - 1})")
    return host


def _confidence(proposal: Proposal, nodes: int) -> Optional[List[float]]:
    values = proposal.confidence
    if values is None:
        return None
    try:
        values = [float(v) for v in values]
    except (TypeError, ValueError):
        raise Malformed("its confidences are not numbers") from None
    if len(values) != nodes or not all(0.0 <= v <= 1.0 for v in values):  # (NaN fails too)
        raise Malformed(f"it needs one confidence from 0 to 1 per node ({nodes})")
    return values


def _parent_error(node: int, parent: int) -> Malformed:
    return Malformed(f"node {node}'s parent {parent} does not come before it (parents first; -1: the root)")


@lru_cache(maxsize=256)
def _shape(parents: Tuple[int, ...], room: int, nodes: int) -> Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]:
    """A tree known by its parents alone, within the budget: the kept nodes, their parents
    renumbered and their depths. The same every round for a static tree (cached)."""
    place: List[Optional[int]] = []
    kept: List[int] = []
    new_parents: List[int] = []
    depths: List[int] = []
    for node, parent in enumerate(parents):
        if not -1 <= parent < node:
            raise _parent_error(node, parent)
        at = place[parent] if parent >= 0 else -1
        depth = 1 if parent < 0 else (depths[at] + 1 if at is not None else room + 1)
        if at is None or depth > room or len(kept) >= nodes:
            place.append(None)
            continue
        place.append(len(kept))
        kept.append(node)
        new_parents.append(at)
        depths.append(depth)
    return tuple(kept), tuple(new_parents), tuple(depths)


def _merged(parents: Sequence[int], tokens: Sequence[int], confidence: Optional[List[float]],
            budget: Budget) -> Tuple[DraftTree, Optional[List[float]]]:
    """A tree whose tokens are on the host, its duplicate siblings merged (a merged node
    keeps the higher confidence), within the budget."""
    tree = DraftTree()
    scores: Optional[List[float]] = [] if confidence is not None else None
    place: List[Optional[int]] = []
    children: dict = {}
    for node, (parent, token) in enumerate(zip(parents, tokens)):
        if not -1 <= parent < node:
            raise _parent_error(node, parent)
        at = place[parent] if parent >= 0 else -1
        if at is None or (tree.depths[at] if at >= 0 else 0) + 1 > budget.room:
            place.append(None)
            continue
        same = children.setdefault(at, {}).get(token)
        if same is not None:
            place.append(same)
            if scores is not None:
                scores[same] = max(scores[same], confidence[node])
            continue
        if len(tree) >= budget.nodes:
            place.append(None)
            continue
        place.append(tree.add(token, at))
        children[at][token] = place[-1]
        if scores is not None:
            scores.append(confidence[node])
    return tree, scores


def _paying(tree: DraftTree, confidence: List[float], budget: Budget) -> List[int]:
    """The nodes worth verifying: taken by the chance that they are accepted (the product of
    their path's confidences), most likely first, as many as give the most expected tokens
    per unit of what they cost on this device's curve (not merely until the next one does
    not pay: a curve with steps can make a few more pay where one alone would not); in
    node order."""
    chance: List[float] = []
    for node, parent in enumerate(tree.parents):
        chance.append(confidence[node] * (chance[parent] if parent >= 0 else 1.0))
    order = sorted(range(len(tree)), key=lambda node: (-chance[node], node))  # parents before children
    expected, best, best_value = budget.expected, 0, budget.expected / budget.cost(0)
    for count, node in enumerate(order, 1):
        expected += chance[node]
        value = expected / budget.cost(count)
        if math.isfinite(value) and value > best_value:
            best, best_value = count, value
    return sorted(order[:best])
