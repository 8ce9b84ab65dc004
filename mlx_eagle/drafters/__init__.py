"""Draft sources behind one seam: the ``Drafter`` protocol.

A round asks the drafter for a ``Proposal``, a tree of candidate tokens after the root
(the token the target already chose), within a ``Budget``; the target verifies it in one
forward pass; then every drafter ``observe``s the ``Outcome``: the committed tokens, the
target's states at the entries it just added, and how many of its own nodes were
accepted. Reading the prompt ends in an ``observe`` too, with no proposal, so a drafter
learns the committed state the same way whether it came from a prompt or a round.

Several sources draft together through ``Composite`` (composite.py), which merges their
trees so that a shared prefix is verified once. A new kind of drafter is one module in
this package that defines a ``Drafter`` and the kind's hooks (see ``kinds.KINDS``), one
line in ``KINDS``, and its tests.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from ..trees import DraftTree

DRAFTER_TIME_LIMIT = 10.0  # seconds: Drafter.time_limit's default


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share (what ``Drafter.reusable`` is asked about)."""
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


@dataclass
class Budget:
    """What a drafter may add to this round's tree, and what its nodes would cost.

    A proposal past ``room`` or ``nodes`` is cut (drafters/admit.py says in which order);
    ``cost(k)`` prices k more nodes on this device's measured curve, so a drafter can stop
    where its next node would not pay: a node accepted with chance c pays while
    ``(expected + c) / cost(k + 1) > expected / cost(k)``. A drafter that attaches a
    confidence to each node (``Proposal.confidence``) is cut by that rule for it."""

    room: int  # how deep a node may be: tokens the reply and the context still have room for
    nodes: int  # how many nodes it may add
    verified: int = 1  # tokens the round verifies already: the root and the nodes before this drafter's
    expected: float = 1.0  # tokens those are expected to yield (the bonus token included)
    chain: bool = False  # the target verifies chains only (no tree path for its architecture)
    # This round's prices for this conversation (costs.Pricing: a forward over k tokens in
    # plain steps, at its context and beside the batch's other rows; None: unmeasured).
    pricing: Optional[Callable[[int], float]] = None
    vocab: Optional[int] = None  # the target's vocabulary: token ids from 0 to vocab - 1

    def cost(self, more: int) -> float:
        """What the round's forward pass costs with ``more`` nodes beside the ``verified``
        tokens, in plain decoding steps (one token: 1); where nothing was measured, a token
        a step."""
        tokens = self.verified + more
        return float(self.pricing(tokens)) if self.pricing is not None else float(tokens)


@dataclass
class Proposal:
    """A drafter's part of a round: a tree after the root and its tokens, in node order.
    ``tokens`` may still be computing on the device; ``tree.tokens`` holds them on the
    host when the drafter has them there (empty otherwise)."""

    tree: DraftTree
    tokens: mx.array  # [nodes] int32 target ids
    # Per node, the drafter's chance that the target accepts it once its parent is accepted
    # (0 to 1); given, the round keeps only the nodes that pay on this device (see Budget).
    confidence: Optional[Sequence[float]] = None

    @staticmethod
    def chain(tokens: Union[Sequence[int], mx.array], confidence: Optional[Sequence[float]] = None) -> "Proposal":
        """``tokens`` in a row after the root (a list, or an array still on the device)."""
        count = len(tokens)
        if isinstance(tokens, mx.array):
            return Proposal(DraftTree([], list(range(-1, count - 1)), list(range(1, count + 1))),
                            tokens.astype(mx.int32), confidence)
        tokens = [int(t) for t in tokens]
        outside = next((t for t in tokens if not 0 <= t < 1 << 31), None)
        if outside is not None:
            raise ValueError(f"Proposal.chain: token id {outside} is not a token id (0 to 2**31 - 1)")
        return Proposal(DraftTree(tokens, list(range(-1, count - 1)), list(range(1, count + 1))),
                        mx.array(tokens, dtype=mx.int32), confidence)

    def only(self, nodes: List[int]) -> "Proposal":
        """Its ``nodes`` alone (each node's parent among them, in node order), renumbered."""
        tokens = self.tokens[mx.array(nodes, dtype=mx.int32)] if nodes else self.tokens[:0]
        confidence = None if self.confidence is None else [self.confidence[node] for node in nodes]
        return Proposal(self.tree.subtree(nodes), tokens, confidence)

    def host_tokens(self) -> List[int]:
        if len(self.tree.tokens) != len(self.tree):
            self.tree.tokens = self.tokens.tolist()
        return self.tree.tokens

    def __len__(self) -> int:
        return len(self.tree)


@dataclass
class TargetStates:
    """The target's states at some positions: the states entering each of ``taps`` (its
    layers), concatenated in that order, and the post-norm last state. ``rows``: which
    rows of the forward pass they are (None: all), gathered when first read."""

    features: Optional[mx.array]  # [tokens, len(taps) * hidden]; the post-norm state where taps is empty
    hidden: Optional[mx.array]  # [tokens, hidden]
    taps: Tuple[int, ...] = ()
    rows: Optional[mx.array] = None

    def read(self, taps: Sequence[int]) -> mx.array:
        """The states entering ``taps`` concatenated (all of them among ``self.taps``); the
        post-norm last state for no taps."""
        taps = tuple(taps)
        if not taps:
            states = self.hidden
        elif taps == self.taps:
            states = self.features
        else:
            width = self.features.shape[-1] // len(self.taps)
            states = mx.concatenate([self.features[..., self.taps.index(t) * width:(self.taps.index(t) + 1) * width]
                                     for t in taps], axis=-1)
        return states if self.rows is None else states[self.rows]


@dataclass
class Outcome:
    """What a round (or reading the prompt) committed, for a drafter to learn from.

    ``tokens``: every committed token, the new root last. The target's cache now holds
    entries for positions ``start`` .. len(tokens) - 2 that it did not hold before, and
    ``states`` are its states at exactly those entries (None where the drafters read
    none). ``proposal``: what this drafter proposed this round (None when it proposed
    nothing, or the prompt was read); ``path``: its nodes that were accepted, root's child
    first. ``from_prompt``: a prompt was read, and the tokens from ``start`` on may differ
    from those the drafter saw before (a conversation that went another way). ``kept``:
    where a batch's pass verified only some of what the drafter proposed (the nodes that
    paid across its rows: node_odds.py), those nodes, in the numbering it proposed them
    in; ``proposal`` and ``path`` are then of those alone, renumbered: what was verified
    (an empty proposal where none was)."""

    tokens: List[int]
    start: int
    states: Optional[TargetStates] = None
    proposal: Optional[Proposal] = None
    path: List[int] = field(default_factory=list)
    from_prompt: bool = False
    kept: Optional[List[int]] = None

    @property
    def accepted(self) -> int:
        return len(self.path)

    @property
    def new_tokens(self) -> List[int]:
        """The tokens after each new entry: what was committed since the last outcome."""
        return self.tokens[self.start + 1:]


class Drafter:
    """A draft source. Subclass it and override ``propose`` (and ``observe`` to learn);
    the defaults read no target states and keep no state of their own.

    ``taps``: None when the drafter reads no target states; else the target layers whose
    entering states it reads (``()``: only the post-norm last state), delivered in
    ``Outcome.states``. Reading states needs an architecture target.py drives."""

    taps: Optional[Tuple[int, ...]] = None
    # Your own drafter (plan.FreshPerConversation): seconds a ``propose`` may take before its
    # conversation goes on without it (None: as long as it takes).
    time_limit: Optional[float] = DRAFTER_TIME_LIMIT

    def propose(self, budget: Budget) -> Optional[Proposal]:
        """This round's drafts after the root: at most ``budget.nodes`` nodes, none deeper
        than ``budget.room``. None (or an empty proposal): nothing to add."""
        return None

    def observe(self, outcome: Outcome) -> None:
        """Learn what was committed (and what of this drafter's proposal was accepted)."""

    def finish(self) -> None:
        """The reply is over (the generation stopped): what was committed is final."""

    def learners(self, outcome: Outcome) -> List[Tuple["Drafter", Outcome]]:
        """The drafters that learn from ``outcome``, each with what it is to observe: this
        one (a Composite: each of its sources, with its own part). ``observe_rows`` groups
        a batch's learners by kind."""
        return [(self, outcome)]

    @classmethod
    def observe_together(cls, drafters: Sequence["Drafter"], outcomes: Sequence[Outcome]) -> None:
        """Several conversations' drafters of this kind observe their outcomes of one
        batched round. The default observes them one after another (``observe_rows`` does
        that itself, each conversation's error its own); a kind backed by a model overrides
        this to do its device work for every conversation in one pass."""
        for drafter, outcome in zip(drafters, outcomes):
            drafter.observe(outcome)

    def reusable(self, common: int) -> int:
        """A new prompt shares its first ``common`` tokens with what was committed: how many
        leading target positions this drafter's state is still good for (the prompt is
        read again from the smallest answer, and ``observe`` then starts there)."""
        return common

    def branch(self) -> Optional["Drafter"]:
        """A copy of this drafter for a new conversation that begins as this one's did (the
        prefix cache hands it a copy of this conversation's target caches): what it learned
        and the state it holds, which ``reusable`` then cuts back to what the two share.
        None (the default): the new conversation gets fresh drafters, and the shared
        beginning is read again where their ``reusable`` keeps none of it."""
        return None

    def fork(self) -> "Drafter":
        """A fresh drafter for a new conversation: the same settings and read-only data,
        none of this one's conversation state. Every conversation gets one (the plan forks
        the drafter it is handed). The default copies the object and, deeply, the lists,
        dicts and sets it holds, sharing everything else (a model, a tokenizer, arrays);
        override it where fresh means something else."""
        fresh = copy.copy(self)
        for name, value in getattr(self, "__dict__", {}).items():
            # (an MLX module is a dict too: a model the drafter holds is shared, not copied)
            if isinstance(value, (list, dict, set, bytearray)) and not isinstance(value, nn.Module):
                setattr(fresh, name, copy.deepcopy(value))
        return fresh


def observe_rows(drafters: Sequence[Drafter], outcomes: Sequence[Outcome]) -> List[Optional[Exception]]:
    """Each conversation's drafter of a batched round observes its outcome, the learners
    (``Drafter.learners``) of a kind that overrides ``observe_together`` handed to it
    together. Returns each conversation's error (None: it observed). One conversation's
    error is not another's, but where a kind observing together fails, every conversation
    it held fails with it."""
    errors: List[Optional[Exception]] = [None] * len(drafters)
    kinds: Dict[type, List[Tuple[int, Drafter, Outcome]]] = {}
    for row, (drafter, outcome) in enumerate(zip(drafters, outcomes)):
        try:
            for learner, part in drafter.learners(outcome):
                kinds.setdefault(type(learner), []).append((row, learner, part))
        except Exception as error:
            errors[row] = error
    for kind, learners in kinds.items():
        learners = [(row, learner, part) for row, learner, part in learners if errors[row] is None]
        together = kind.observe_together.__func__ is not Drafter.observe_together.__func__
        for group in [learners] if together else [[one] for one in learners]:
            try:
                kind.observe_together([learner for _, learner, _ in group], [part for _, _, part in group])
            except Exception as error:
                for row, _, _ in group:
                    errors[row] = error
    return errors
