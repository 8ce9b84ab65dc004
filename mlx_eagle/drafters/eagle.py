"""EAGLE heads as a drafter: the head's tree for the next round is grown as soon as the
target commits tokens, queued on the device while the host streams them (the tree grown
by tree_growth.TreeDrafter).

A node is fed to the head as (its parent's draft output, its own token) at position
root + depth; it attends to the committed draft cache and its own ancestors, and the
tree's draft KV entries are dropped once the tree is grown. The head's cache keeps only
committed tokens: each round it reads the accepted tokens with the target's fresh states.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from .calibrate import auto_tree
from ..heads import HEADS, Head, load_head, shipped_head_dir
from ..target import check_target, is_driven, keep_cache_entries, layer_count
from ..trees import TreeSpec, chain_of, parse_tree
from . import Budget, Drafter, Outcome, Proposal
from .kinds import DraftSettings, DraftSource
from .tree_growth import TreeDrafter

NAME = "eagle"


class EagleDrafter(Drafter):
    """An EAGLE head (EAGLE-1/2/3, or any object with the ``Head`` interface) drafting a
    ``tree`` each round.

    With ``pricing`` (a forward over k tokens in plain steps: the device's curve, where a
    round's Budget brings no prices of its own), the tree is held to what it measurably
    buys: once ``WARMUP`` rounds show its accepted tokens not paying for the nodes it adds,
    it drafts only every ``PROBE``-th round (to notice a change of topic), so a head whose
    recorded acceptance was wrong, or that has none, costs at most a probe round in ``PROBE``
    on any device. In a batch, what it yields is what the pass verified of its tree (the
    nodes that paid across the rows: node_odds.py), so a head whose trees the batch keeps
    cutting away holds back too."""

    WARMUP = 8  # rounds measured before the tree may be held back
    PROBE = 16  # while held back, one round in this many drafts
    MEMORY = 0.9  # weight of the past in the running means (about the last 10 rounds)
    # A long prompt is read this many tokens at a time, as the target reads it: the head's
    # attention over one block of n tokens holds n x n scores (150 MB at 2k on SmolLM2's head).
    READ_CHUNK = 512

    def __init__(self, head: Head, target: nn.Module, tree: TreeSpec,
                 pricing: Optional[Callable[[int], float]] = None):
        self.taps = tuple(head.taps(layer_count(target)) or ())
        check_target(target, self.taps)
        self.head, self.target, self.pricing = head, target, pricing
        self.grower = TreeDrafter(head, target, tree)
        self.cache = [KVCache()]  # the head's, for committed tokens only
        self.queued: Optional[Proposal] = None  # the next round's tree, grown on the device
        self.rounds = 0  # rounds its tree was verified in
        self.accepted = 0.0  # running mean of its nodes accepted a round
        self.nodes = 0.0  # running mean of the nodes it added a round
        self.held = 0  # rounds held back since the last probe (0: drafting)
        self.probing = False  # this round's tree is a probe while held back
        self.pricing_seen: Optional[Callable[[int], float]] = None  # the last round's prices (its Budget's)
        # While held back, what was committed is kept unread (the target's states at the
        # positions after the head's cache, and the tokens after them), and read in one pass
        # before the next probe: a head that does not pay costs nearly nothing between probes.
        self.unread: Optional[Tuple[mx.array, List[int]]] = None

    def reusable(self, common: int) -> int:
        # The head's entry at t pairs feature t with token t + 1: still good only where
        # token t + 1 is shared too.
        return min(self.cache[0].offset, max(common - 1, 0))

    def branch(self) -> "EagleDrafter":
        # The head's cache copied (cut back by reusable); its measured yield kept; the
        # compiled tree grower shared, so a new conversation does not trace it again.
        twin = copy.copy(self)
        twin.cache, twin.queued = copy.deepcopy(self.cache), None
        return twin

    def observe(self, outcome: Outcome) -> None:
        """Read the committed (feature, next token) pairs and grow the next round's tree,
        queued on the device; its tokens stay there."""
        unread = self._learn(outcome)
        if unread is not None:
            self._read_and_grow(*self._read_long(*unread))

    @classmethod
    def observe_together(cls, drafters: Sequence["EagleDrafter"], outcomes: Sequence[Outcome]) -> None:
        """Each drafter observes its outcome; those drafting one static tree with one head
        read their committed tokens and grow their next trees together, one head pass for
        the reads and one a depth for every conversation (TreeDrafter.read_and_draft_rows)."""
        groups: Dict[tuple, List[Tuple[EagleDrafter, mx.array, mx.array]]] = {}
        for drafter, outcome in zip(drafters, outcomes):
            unread = drafter._learn(outcome)
            if unread is None:
                continue
            features, tokens = drafter._read_long(*unread)
            grower = drafter.grower
            key = (id(drafter.head), id(drafter.target), tuple(grower.spec.paths)) \
                if grower.drafts_rows() and tokens.size else (id(drafter),)
            groups.setdefault(key, []).append((drafter, features, tokens))
        for group in groups.values():
            if len(group) == 1:
                group[0][0]._read_and_grow(*group[0][1:])
                continue
            drafted = group[0][0].grower.read_and_draft_rows([(f, t, d.cache) for d, f, t in group])
            for (drafter, _, _), (tree, tree_tokens) in zip(group, drafted):
                drafter.queued = Proposal(tree, tree_tokens)
            mx.async_eval([tree_tokens for _, tree_tokens in drafted])

    def _learn(self, outcome: Outcome) -> Optional[Tuple[mx.array, List[int]]]:
        """The bookkeeping of ``observe``: the head's cache cut back to the outcome's start,
        the tree's yield counted; returns what is to be read now (the target's states and
        the tokens after them, the backlog kept while held back included), or None where
        the head is held back next round (kept unread)."""
        keep_cache_entries(self.cache, outcome.start, [])
        features, tokens = outcome.states.read(self.taps), outcome.new_tokens
        if self.unread is not None:  # the backlog up to this outcome's start (all of it but after a new prompt)
            behind, kept = self.unread[0], max(0, outcome.start - self.cache[0].offset)
            features = mx.concatenate([behind[:kept], features]) if kept else features
            tokens = self.unread[1][:kept] + tokens
            self.unread = None
        if outcome.proposal is not None:
            # A probe's outcome weighs more: while held back, it is all there is to go on.
            weight = 0.0 if not self.rounds else 0.5 if self.probing else self.MEMORY
            self.accepted = weight * self.accepted + (1 - weight) * outcome.accepted
            if len(outcome.proposal.tree) or not self.rounds:
                # A tree the batch's pass cut to nothing (node_odds) keeps the size it was last
                # verified at: its yield fades and its size does not, so a head the batch keeps
                # cutting holds back, rather than growing trees no pass verifies.
                self.nodes = weight * self.nodes + (1 - weight) * len(outcome.proposal.tree)
            self.rounds += 1
        if self.held >= self.PROBE - 1 and not self.could_pay():
            # A probe that would not pay were every node accepted (beside many rows, on a
            # device whose every token costs): put off, until the prices change.
            self.held = self.PROBE - 2
        drafting = not 0 < self.held < self.PROBE - 1  # (held back next round too: no tree to grow)
        if not drafting:
            if len(tokens) > 2 * self.READ_CHUNK:  # (a backlog is kept no longer than this)
                features, tokens = self._read_long(features, tokens)
                tokens = tokens.tolist()
            self.unread = (features, tokens)
            return None
        return features, tokens

    def could_pay(self) -> bool:
        """Whether the tree would pay at the last round's prices if every node on its
        deepest path were accepted."""
        pricing = self.pricing_seen or self.pricing
        if pricing is None or not self.rounds:
            return True
        nodes = max(round(self.nodes), 1)
        return (1 + min(self.grower.spec.max_depth, nodes)) / pricing(1 + nodes) > 1 / pricing(1)

    def _read_long(self, features: mx.array, tokens: List[int]) -> Tuple[mx.array, mx.array]:
        """Read all but the last READ_CHUNK tokens (a long prompt's) a chunk at a time;
        returns the rest."""
        tokens = mx.array(tokens)
        while tokens.size > self.READ_CHUNK:
            self.head.step(self.target, self.head.project(features[:self.READ_CHUNK])[None],
                           tokens[None, :self.READ_CHUNK], self.cache, self.cache[0].offset, "causal")
            mx.eval([c.state for c in self.cache])
            tokens, features = tokens[self.READ_CHUNK:], features[self.READ_CHUNK:]
        return features, tokens

    def _read_and_grow(self, features: mx.array, tokens: mx.array) -> None:
        """Read ``tokens`` with the target's ``features`` at them and grow the next tree from
        the last output, queued on the device."""
        if self.grower.reads_and_drafts(tokens.size, self.cache):
            tree, tree_tokens = self.grower.read_and_draft(features, tokens, self.cache)  # one compiled call
        else:
            out = self.head.step(self.target, self.head.project(features)[None], tokens[None], self.cache,
                                 self.cache[0].offset, "causal" if tokens.size > 1 else None)
            tree, tree_tokens = self.grower.draft(out[:, -1], self.cache, self.cache[0].offset - 1)
        mx.async_eval(tree_tokens)
        self.queued = Proposal(tree, tree_tokens)

    def pays(self, budget: Budget) -> bool:
        """Whether the tree, as measured so far, yields more tokens per unit of verify cost
        than the round without it (the other drafters' nodes, ``budget``)."""
        if self.pricing is None or self.rounds < self.WARMUP:
            return True
        pricing = budget.pricing or self.pricing
        without = budget.expected / pricing(budget.verified)
        return (budget.expected + self.accepted) / pricing(budget.verified + round(self.nodes)) > without

    def propose(self, budget: Budget) -> Optional[Proposal]:
        proposal, self.queued = self.queued, None
        self.pricing_seen = budget.pricing or self.pricing_seen
        if proposal is None:  # none was grown: held back (or nothing read yet)
            if self.held:
                self.held += 1
            return None
        self.probing = self.held >= self.PROBE - 1
        if not self.probing and not self.pays(budget):
            self.held += 1
            return None
        self.held = 0
        if proposal is None or max(proposal.tree.depths, default=0) <= budget.room:
            return proposal
        tree = proposal.tree.shallower(budget.room)  # near the end of the reply or the context
        return Proposal(tree, proposal.tokens[:len(tree)])


def recognizes(path: Path, config: Optional[dict]) -> bool:
    """An EAGLE head directory: our own marks or an EAGLE architecture name, or one layer
    and no tokenizer (every EAGLE format has one layer; a model has a tokenizer)."""
    if config is None:
        return False
    architectures = config.get("architectures") or []
    tokenizer = any((path / name).exists() for name in ("tokenizer.json", "tokenizer.model"))
    return ((isinstance(config.get("family"), str) and config["family"] in HEADS) or "draft_vocab_size" in config
            or any(isinstance(a, str) and "eagle" in a.lower() for a in architectures)
            or (config.get("num_hidden_layers") == 1 and not tokenizer))


def load(directory: Path, model: nn.Module) -> Head:
    return load_head(directory, model)


def accepts(draft: object) -> bool:
    return all(callable(getattr(draft, name, None)) for name in ("taps", "project", "step", "logits", "target_ids"))


def shipped(model: nn.Module) -> Optional[Head]:
    """The head shipped in this package for ``model``, if any."""

    found = shipped_head_dir(model)
    return load_head(found, model) if found is not None else None


def source(head: Head, model: nn.Module, settings: DraftSettings) -> DraftSource:
    """The head drafting the tree ``settings.tree`` names (``auto``: tuned or calibrated for
    this device; none where it is expected to lose)."""

    tree, why, pricing = settings.tree, None, None
    if tree is None or tree == "auto":
        tree, why = auto_tree(model, head)
        pricing = settings.costs.at()  # a tree chosen for the user is held to what it measurably buys
    elif isinstance(tree, str):
        tree = parse_tree(tree)
    if not is_driven(model):
        tree = chain_of(tree)
    family = getattr(head, "family", "draft")
    if tree.kind == "none":
        return DraftSource(f"{family} head", None, why or "tree none")
    return DraftSource(f"{family} head, tree {tree.text}", lambda: EagleDrafter(head, model, tree, pricing), why, head)
