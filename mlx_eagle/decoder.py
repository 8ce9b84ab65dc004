"""The decoding loop, draft -> verify -> accept, readable in one sitting.

State between rounds: the target's KV cache holds every committed token but the
last one, the *root*, which the target chose and which starts the next round. Both
live in a ``PromptCache`` with the drafter that drafts for them, which a conversation
keeps from turn to turn: a new prompt that begins with what the caches hold is read
from where they diverge.

One round: the drafter (see drafters/; several sources merge through a Composite)
proposes a tree of tokens after the root; the target runs [root, tree] in one forward
pass with a tree mask; the longest agreeing path is accepted plus one bonus token from
the target; the cache keeps only that path; the drafter observes what was committed,
with the target's states at the kept entries where it reads them. A drafter that
prepares the next round's tree then queues that work on the device before the
round's tokens are handed out, so the device drafts while the host streams them. The
host waits for the device once per round, for what the walk along the tree needs.
A chain needs no tree mask: where target.py does not know the architecture, the
model's own forward pass verifies it, so any mlx-lm model can decode this way (an EAGLE-3
head reads the states entering its taps on the way: target.tapped_forward). A hybrid
model's recurrent layers cannot cut their cache back (rewind.py): their inputs are
recorded during the verify pass, and a round that rejects part of its chain replays
their recurrence over the accepted steps only. (Nor can a sliding-window cache of a model
target.py does not drive, once it has wrapped.) Where a model's layers are not ones
rewind.py knows, the round restores the caches to before its forward pass instead, and
the next round reads the accepted tokens again in front of its own chain ("unread" tokens).
A reply held to a grammar (structured outputs) has each round's tree shaped by it before
the forward pass, and the rows masked after it (grammar.py): the same loop, the same walk.
A thinking budget (thinking.py) shapes and masks a round the same way.
"""

from __future__ import annotations

import itertools
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import Callable, ContextManager, Generator, Iterator, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from .costs import Costs, kv_logit_drift
from .drafters import Budget, Drafter, Outcome, Proposal, TargetStates, observe_rows
from .drafters.admit import admit_or_warn
from .distributed import check_same, shared_proposal, sharded
from .errors import UserError
from .grammar import Grammar, Shaped, mask_logits
from .node_odds import NodeOdds, choose_across, slots
from .thinking import ThinkingBudget
from .prompt_cache import PromptCache, make_prompt_cache
from .rewind import Rewind, needs_rewind
from .compiled import compiles_verification, verify_block
from .target import MLX_LM_PREFILL_STEP, Block, KVQuantization, Mask, TargetOutput, check_target, is_driven, \
    keep_cache_entries, lm_head, packed_forward, packs, tapped_forward, target_forward, tree_mask
from .trees import MAX_TREE_NODES, DraftTree
from .verify import Sampling, accept

NO_TOKENS = mx.array([], dtype=mx.int32)


@dataclass
class Round:
    tokens: List[int]  # the accepted draft tokens, then the bonus token
    drafted: int  # tree nodes the target verified
    logits: Optional[mx.array] = None  # with keep_logits: the rows each token was chosen from [tokens, vocab]
    rows: int = 1  # conversations whose blocks the verify pass held (batched_round)


@dataclass
class Accepted:
    """A round's verdict, committed to the target's caches, before the drafters observe it."""

    round: Round
    tokens: List[int]  # every committed token, the new root last
    outcome: Optional[Outcome]  # what the drafters are to observe (None: there are none)


@dataclass
class Drafted:
    """What a round verifies, between ``draft`` and ``conclude``."""

    committed: List[int]  # the tokens committed before the round, the root last
    unread: List[int]  # committed tokens the caches do not hold yet (read in front of the root)
    proposal: Optional[Proposal]  # the drafter's, as admitted (None: nothing drafted)
    tree: DraftTree  # what is verified after the root (the proposal's tree, shaped)
    tokens: mx.array  # its tokens
    shaped: Optional[Shaped]  # a grammar's shaping of it
    # Where a batch chose its nodes across rows (node_odds): each node's (depth - 1, sibling
    # rank) in the tree as drafted, and where it verifies only some of the proposal, its
    # nodes kept (``proposal``, ``tree`` and ``tokens`` are then those alone).
    slots: Optional[List[Tuple[int, int]]] = None
    kept: Optional[List[int]] = None

    def cut(self, keep: List[int]) -> "Drafted":
        """Only the nodes ``keep`` verified (parents before children, in node order), and
        the proposal the drafter learns from cut alike."""
        proposal = self.proposal.only(keep)
        return replace(self, proposal=proposal, tree=proposal.tree, tokens=proposal.tokens,
                       slots=[self.slots[node] for node in keep], kept=keep)


@dataclass(eq=False)
class PromptChunk:
    """A span of a prompt to be read inside another's packed pass: read_prompt yields it
    where its decoder ``rides``, the caller runs ``block`` in a pass (batched_round's
    ``reading``), sets ``out`` and resumes the reading."""

    block: Block
    out: Optional[TargetOutput] = None


# The points of a round a phase hook hears about, in order (benchmarks time them).
PHASES = ("drafted", "verified", "observed")
# Past this many unread tokens a round drafts nothing, so that its forward pass catches up.
MAX_UNREAD = 8
# A block row's top two logits closer than this many times the measured drift between a
# block and one-row passes (costs.logit_drift) are decided as plain decoding decides them.
DRIFT_MARGIN = 8.0


class SpeculativeDecoder:
    """One conversation's decoding: ``prefill`` reads a prompt into its ``PromptCache`` and
    chooses the first token; each ``round`` drafts after it, verifies in one forward pass,
    accepts and commits (see the module's docstring); ``truncate`` cuts what was committed
    back to what was handed out. Every setting is given here, once."""

    def __init__(self, target: nn.Module, drafter: Optional[Drafter], sampling: Sampling,
                 seed: Optional[int] = None, cache: Optional[PromptCache] = None,
                 on_phase: Optional[Callable[[str], None]] = None, costs: Optional[Callable[[], Costs]] = None,
                 grammar: Union[Grammar, ThinkingBudget, None] = None, kv: Optional[KVQuantization] = None,
                 keep_logits: bool = False, odds: Optional[NodeOdds] = None):
        """``drafter``: what drafts each round (None: plain decoding through the same loop).
        ``on_phase``: called with each of PHASES as a round passes it. ``costs``: this
        device's measured costs for the target (asked for when a round first needs them),
        which drafters size their trees by and whose logit drift makes greedy rounds exact.
        ``grammar``: the reply's structured-output state (grammar.py), or its thinking budget
        (thinking.py); None: free text.
        ``kv``: quantized KV caches (target.KVQuantization), checked against the caches.
        ``keep_logits``: keep the rows each committed token was chosen from (``Round.logits``,
        ``root_logits``), for log-probabilities. ``odds``: what a batch's choice of nodes
        starts from (None: node_odds' prior alone)."""
        self.reads_states = drafter is not None and drafter.taps is not None
        if self.reads_states:
            check_target(target, drafter.taps)
        # Verifying through target.py's compiled pieces where it knows the architecture;
        # any other mlx-lm model verifies chains through its own forward pass.
        self.drives_target = is_driven(target)
        self.target, self.drafter, self.sampling = target, drafter, sampling
        self.taps = drafter.taps if self.reads_states else None
        self.on_phase = on_phase or (lambda phase: None)
        # Every position samples with noise fixed by (seed, position) (verify.py); without a
        # seed, one drawn from MLX's global generator (mx.random.seed makes it reproducible).
        self.seed = seed if seed is not None else int(mx.random.randint(0, 2**31 - 1, ()).item())
        self.state = cache if cache is not None else make_prompt_cache(target)
        self.state.bind(target, kv)
        self.reused = 0  # prompt tokens the last prefill found already in the caches
        self.read_chunk: Optional[int] = None  # prompt tokens the next pass reads (None: read_prompt's chunk)
        # Whether the prompt's next span is read inside a batch's packed pass (read_prompt
        # yields a PromptChunk; the scheduler sets it where such a pass runs). The span that
        # ends the prompt rides where target.py drives the target (_rides).
        self.rides = False
        self.forwards = 0  # target forward passes, for tests and statistics
        self.rechecked = 0  # greedy positions too close to call in a block, decided by a one-row pass
        # What was accepted by depth and rank, for a batch's choice of nodes.
        self.odds = odds if odds is not None else NodeOdds()
        self._costs_of = costs
        self._costs: Optional[Costs] = None
        # How close a block row's top two logits may come (None: from the costs, when first needed).
        self.tolerance: Optional[float] = None
        self.vocab: Optional[int] = None  # the target's, known from its first logits
        self.root: Optional[int] = None
        # (the verify pass's own rows along the accepted path)
        self.keep_logits = keep_logits
        self.root_logits: Optional[mx.array] = None
        self.grammar, self.kv = grammar, kv
        # A target sharded over several ranks: every rank runs the same rounds (distributed.py),
        # so every rank's drafters read the same states (a rank reading none runs other passes).
        self.shards = sharded()
        if self.shards:
            check_same(repr(self.taps), "drafting plan (the target states its drafters read)",
                       "give every rank the same drafter files and settings")

    @property
    def target_cache(self) -> List:
        return self.state.target

    @property
    def rewind(self) -> Optional[Rewind]:
        """What rolls back the caches mlx-lm cannot cut back (recurrent layers, wrapped sliding windows)."""
        return self.state.rewind

    @property
    def length(self) -> int:
        """Tokens committed so far, the root included."""
        return len(self.state.tokens)

    def _measured(self) -> Costs:
        """This device's costs for the target, asked for once, when a round first needs them."""
        self._costs = self._costs if self._costs is not None else self._costs_of()
        return self._costs

    def _tolerance(self) -> float:
        if self.tolerance is None:
            drift = self._measured().logit_drift if self._costs_of is not None else None
            if drift is not None and self.kv is not None:  # quantized kernels round their own ways
                drift = max(drift, kv_logit_drift(self.target, self.kv))
            self.tolerance = DRIFT_MARGIN * drift if drift else 0.0
        return self.tolerance

    def _choose(self, logits: mx.array, position: int) -> int:
        """The token at ``position``, chosen from its one-row ``logits``."""
        self.vocab = logits.shape[-1]
        return int(self.sampling.choices(logits[None], self.seed, [position])[0].item())

    def _forward(self, tokens: mx.array, positions, mask) -> TargetOutput:
        self.forwards += 1
        if not self.drives_target:  # only chains, starting where the cache ends: the model's own forward pass
            if not self.reads_states:
                return TargetOutput(logits=self.target(tokens[None], cache=self.target_cache)[0], features=None)
            out = tapped_forward(self.target, tokens[None], self.target_cache, self.taps)
            return TargetOutput(logits=out.logits[0], features=out.features[0], hidden=out.hidden[0])
        out = target_forward(self.target, tokens[None], self.target_cache, positions, mask, self.taps or None)
        return TargetOutput(logits=out.logits[0], features=out.features[0], hidden=out.hidden[0])

    def prefill(self, prompt: List[int], chunk: int = 512,
                on_read: Optional[Callable[[int, int], None]] = None) -> int:
        """Read the prompt (``read_prompt``); the first generated token (the first root).
        ``on_read(read, total)`` hears after each chunk (it may raise to stop)."""
        for read, total in self.reading(prompt, chunk):
            if on_read is not None:
                on_read(read, total)
        return self.root

    def reading(self, prompt: List[int], chunk: int = 512) -> Iterator[Union[Tuple[int, int], "PromptChunk"]]:
        """``prefill`` a chunk at a time (a server reads between rounds, or inside their
        passes): ``read_prompt``."""
        return read_prompt(self, prompt, chunk)

    def _held(self, logits: mx.array) -> mx.array:
        """The prompt's last logits, held to the grammar (if any) where the reply begins."""
        allowed = self.grammar.mask_now() if self.grammar is not None else None
        return mask_logits(logits[None], allowed)[0] if allowed is not None else logits

    def _unsure(self, logits: mx.array, position: int) -> bool:
        """Whether the choice read from a block row may differ from a one-row pass's."""
        tolerance = self._tolerance()
        return tolerance > 0 and bool(self.sampling.choices(logits[None], self.seed, [position], tolerance)[1].item())

    def _verified_tokens(self, tree: DraftTree, tokens: mx.array, unread: List[int]) -> mx.array:
        """What the verify pass reads: [unread tokens, root, tree]."""
        if not tree.is_chain() and not self.drives_target:
            raise UserError("a draft tree (not a chain) needs a target architecture target.py drives")
        if not tree.tokens and tokens.size:  # ids still on the device, unchecked: one outside is read as 0
            tokens = mx.where((tokens >= 0) & (tokens < self.vocab), tokens, 0)
        return mx.concatenate([mx.array(unread + [self.root], dtype=mx.int32), tokens.astype(mx.int32)])

    def _block(self, tree: DraftTree, tokens: mx.array, unread: List[int]) -> Block:
        """The verify pass's input, at its positions (where target.py drives the target),
        under a causal mask (a chain) or the tree's."""
        tokens = self._verified_tokens(tree, tokens, unread)
        start = self.target_cache[0].offset if self.drives_target else None  # positions: where target.py drives
        if tree.is_chain():  # a chain is just a longer causal block
            return Block(tokens, self.target_cache, start, "causal" if tokens.size > 1 else None, self.taps or None)
        return Block(tokens, self.target_cache, start + mx.array([0] + tree.depths),
                     tree_mask(start, tree.ancestor_matrix()), self.taps or None)

    def _before_verify(self, drafted: Drafted) -> ContextManager[Optional[List]]:
        return self.state.before_verify(len(drafted.tree), len(drafted.committed), len(drafted.unread))

    def _verify(self, tree: DraftTree, tokens: mx.array, unread: List[int]) -> TargetOutput:
        """The target's forward pass over [unread tokens, root, tree], appended to its cache;
        the outputs from the root on."""
        if not unread and compiles_verification(self.target, self.target_cache, 1 + tokens.size):
            self.forwards += 1
            start = self.target_cache[0].offset
            positions = [start] + [start + depth for depth in tree.depths]
            return verify_block(self.target, self._verified_tokens(tree, tokens, unread), self.target_cache,
                                positions, tree.ancestors(), self.taps or None)  # one compiled call
        block = self._block(tree, tokens, unread)
        out = self._forward(block.tokens, block.positions, block.mask)
        if not unread:
            return out
        return TargetOutput(out.logits[len(unread):], out.features[len(unread):] if self.reads_states else None,
                            out.hidden[len(unread):] if self.reads_states else None)

    def round(self, room: int) -> Round:
        """One round. ``room``: how many tokens past the root may still be produced.
        The host waits for the device once, in ``accept``."""
        drafted = self.draft(room)
        with self._before_verify(drafted) as recorded:
            out = self._verify(drafted.tree, drafted.tokens, drafted.unread)
        return self.conclude(drafted, out, recorded)

    def draft(self, room: int, beside: Tuple[int, int] = (0, 1)) -> Drafted:
        """A round's first half: what is verified after the root (the drafter's proposal,
        admitted, shared between ranks and shaped by a grammar). The caches hold nothing
        certain until ``conclude``. ``beside``: (tokens, rows) the packed pass verifies for
        other conversations, which prices this one's nodes (costs.Pricing)."""
        committed = self.state.begin()  # (an interrupted round leaves nothing certain)
        unread = committed[len(committed) - 1 - self.state.unread:-1]
        room = self.state.room(len(committed) - 1, room)  # (a round ends where the cache turns quantized)
        proposal = None
        nodes = MAX_TREE_NODES - len(unread) if self.drafter is not None and len(unread) < MAX_UNREAD else 0
        if self.drafter is not None:
            # Verifying costs more deep in a long context, and beside others (costs.Pricing).
            pricing = self._measured().at(len(committed), beside) if self._costs_of is not None else None
            budget = Budget(room=room - 1, nodes=nodes, verified=1 + len(unread), chain=not self.drives_target,
                            pricing=pricing, vocab=self.vocab)
            proposal = admit_or_warn(self.drafter, self.drafter.propose(budget), budget)
        tree, tokens = (proposal.tree, proposal.tokens) if proposal else (DraftTree(), NO_TOKENS)
        if self.shards:  # every rank verifies rank 0's tree, whatever its own drafters proposed (distributed.py)
            tree, tokens, own = shared_proposal(tree, tokens, MAX_TREE_NODES)
            proposal = proposal if own else None
        shaped = None
        # The nodes a grammar allows, masks, forced tokens; the tree's rows reach its depth.
        if self.grammar is not None and self.grammar.binds(min(room, 1 + max(tree.depths, default=0))):
            shaped = self.grammar.shape(proposal.host_tokens() if proposal else tree.tokens, tree.parents, room - 1,
                                        nodes)
            tree, tokens = shaped.tree, shaped.tokens
        self.on_phase("drafted")
        return Drafted(committed, unread, proposal, tree, tokens, shaped)

    def conclude(self, drafted: Drafted, out: TargetOutput, recorded: Optional[List]) -> Round:
        """A round's second half, after the verify pass gave ``out`` (``recorded``: what the
        pass recorded for a rollback): accept, commit, observe."""
        accepted = self.accept_round(drafted, out, recorded)
        if accepted.outcome is not None:
            self.drafter.observe(accepted.outcome)
        return self.settle_round(accepted)

    def accept_round(self, drafted: Drafted, out: TargetOutput, recorded: Optional[List]) -> Accepted:
        """``conclude`` up to the drafters' observing: the verdict, committed to the caches."""
        committed, proposal, tree, tokens, shaped = (drafted.committed, drafted.proposal, drafted.tree,
                                                     drafted.tokens, drafted.shaped)
        start = len(committed) - 1  # the root's position
        exact = self.rewind is None and len(tree) > 0  # (a recurrent state is not re-read one row at a time)
        masked = shaped is not None and shaped.allowed is not None
        logits = mask_logits(out.logits, shaped.allowed) if masked else out.logits
        verdict = accept(tree, tokens, logits, self.sampling, self.seed, start + 1,
                         self._tolerance() if exact else 0.0)
        kept = [0] + [n + 1 for n in verdict.path]
        chosen_from = logits[mx.array(kept)] if self.keep_logits else None
        if verdict.unsure:  # the last kept position read again alone, and its choice made there
            self.state.commit(start, kept[:-1], False, recorded)
            alone = self._forward(mx.array(([self.root] + verdict.tokens)[-1:]), start + len(kept) - 1, None)
            alone_logits = alone.logits[-1:]
            if masked:
                alone_logits = mask_logits(alone_logits, shaped.allowed[kept[-1]:kept[-1] + 1])
            verdict.bonus = self._choose(alone_logits[0], start + len(kept))
            if chosen_from is not None:
                chosen_from = mx.concatenate([chosen_from[:-1], alone_logits])
            self.rechecked += 1
            if self.reads_states:
                rows = mx.array(kept[:-1], dtype=mx.int32)
                out = TargetOutput(None, mx.concatenate([out.features[rows], alone.features]),
                                   mx.concatenate([out.hidden[rows], alone.hidden]))
                kept = list(range(len(kept)))
        else:
            self.state.commit(start, kept, len(verdict.path) == len(tree), recorded)
        self.state.quantize_when_due()
        self.on_phase("verified")
        new = verdict.tokens + [verdict.bonus]
        if self.grammar is not None:
            self.grammar.commit(new, shaped, verdict.path)
        if drafted.slots is not None and len(tree):  # (what a batch's next choice of nodes learns from)
            self.odds.record(drafted.slots, tree.parents, verdict.path)
        outcome = None
        if self.drafter is not None:
            states = None
            if self.reads_states:
                states = TargetStates(out.features, out.hidden, self.taps, rows=mx.array(kept))
            path = (shaped.drafters_path(verdict.path) if shaped is not None else verdict.path) if proposal else []
            # (a proposal the batch cut to nothing is handed over empty: proposed, none verified)
            verified = proposal if proposal or drafted.kept is not None else None
            outcome = Outcome(committed + new, start, states, verified, path,
                              kept=drafted.kept if verified is not None else None)
        return Accepted(Round(tokens=new, drafted=len(tree), logits=chosen_from), committed + new, outcome)

    def settle_round(self, accepted: Accepted) -> Round:
        """``conclude`` after the drafters observed: the round is over."""
        self.on_phase("observed")
        self.root = accepted.round.tokens[-1]
        self.state.settle(accepted.tokens)
        return accepted.round

    def truncate(self, count: int) -> None:
        """Keep only the first ``count`` committed tokens (PromptCache.truncate)."""
        if self.state.truncate(count):
            self.root = self.state.tokens[-1]


def read_prompt(decoder: SpeculativeDecoder, prompt: List[int], chunk: int = 512) -> \
        Iterator[Union[Tuple[int, int], PromptChunk]]:
    """Read ``prompt`` into the decoder's caches (what they do not already hold of it),
    ``chunk`` tokens a pass (with quantized KV caches, as plain mlx-lm reads it), choosing the
    first root: (read, total) after each chunk; where the decoder ``rides``, a PromptChunk
    before each chunk read in another's pass (_read_pass). The decoder's first step, written
    apart from its rounds."""
    decoder.reused = decoder.state.reusable(prompt, decoder.drafter)
    decoder.state.begin()
    last = len(prompt) - 1
    if decoder.kv is not None:
        # In plain mlx-lm's chunks, its cache turning quantized after the same one: the rows
        # of a chunk read before it attend to unquantized keys, and keys computed in other
        # chunks round differently in their last bits, which a quantized cache can turn into
        # another level.
        chunk = MLX_LM_PREFILL_STEP
    states, features, hidden = None, [], []
    # (0, total) first, as mlx-lm's loop says it: how much of the prompt is to be read,
    # known now that the caches' reusable beginning is.
    yield from _chunk_read(decoder, prompt, decoder.reused, features, hidden)
    if not decoder.reads_states:  # as mlx-lm reads a prompt: only the last token's logits are computed
        # Where target.py drives the target, the span that ends the prompt may ride inside a
        # batch's pass too, so that no reply waits on a pass of the last token's own (an
        # agent's turn whose beginning the caches hold is that token and a few more): the
        # root's logits are then the LM head over that pass's last state, rechecked alone on
        # a near tie. A span that ends the prompt read alone leaves its last token to a pass
        # of its own, as mlx-lm reads it.
        ending = None  # (the pass that read the prompt's last token inside a batch's)
        for begin, end in _spans(decoder, len(prompt) if decoder.drives_target and decoder.kv is None else last,
                                 chunk):
            if end == len(prompt) and not _rides(decoder, end, len(prompt)):
                end = last
                if end == begin:
                    break
            out = yield from _read_pass(decoder, prompt, begin, end, features, hidden, _model_pass)
            ending = out if end == len(prompt) else None
            decoder.state.quantize_when_due()
            mx.eval([layer_cache.state for layer_cache in decoder.target_cache])
            decoder.state.keep_beginning(end, prompt)
            yield from _chunk_read(decoder, prompt, end, features, hidden)
        if ending is not None:
            logits, _ = _root_logits(decoder, prompt, ending, check=True)
        else:
            logits = decoder._held(decoder._forward(mx.array(prompt[-1:]), last, None).logits[-1])
        decoder.state.quantize_when_due()
        decoder.root = decoder._choose(logits, len(prompt))
    else:
        # The model's own forward pass computes logits for every token: the last one alone.
        # (So too where the cache may turn quantized before it, as plain decoding's does.)
        last_alone = not decoder.drives_target or decoder.kv is not None
        spans = itertools.chain(_spans(decoder, last, chunk), [(last, len(prompt))]) if last_alone \
            else _spans(decoder, len(prompt), chunk)
        for begin, end in spans:
            rode = _rides(decoder, end, len(prompt))
            out = yield from _read_pass(decoder, prompt, begin, end, features, hidden, SpeculativeDecoder._forward)
            features.append(out.features)
            hidden.append(out.hidden)
            # The prompt's own logits are never needed: only the last. (A recurrent state is
            # computed apart from the outputs: evaluated too, so the graph does not grow.)
            decoder.state.quantize_when_due()
            mx.eval(out.features, out.hidden, [] if decoder.drives_target else [c.state for c in decoder.target_cache])
            decoder.state.keep_beginning(end, prompt)
            yield from _chunk_read(decoder, prompt, end, features, hidden)
        logits, alone = _root_logits(decoder, prompt, out, check=end - begin > 1 or rode)
        if alone is not None:
            features[-1] = mx.concatenate([features[-1][:-1], alone.features])
            hidden[-1] = mx.concatenate([hidden[-1][:-1], alone.hidden])
        decoder.root = decoder._choose(logits, len(prompt))
        states = TargetStates(mx.concatenate(features), mx.concatenate(hidden), decoder.taps)
    decoder.root_logits = logits if decoder.keep_logits else None
    if decoder.grammar is not None:
        decoder.grammar.commit([decoder.root])
    tokens = list(prompt) + [decoder.root]
    if decoder.drafter is not None:
        decoder.drafter.observe(Outcome(tokens, decoder.reused, states, from_prompt=True))
    decoder.state.settle(tokens)


def _root_logits(decoder: SpeculativeDecoder, prompt: List[int], out: TargetOutput, check: bool) -> \
        Tuple[mx.array, Optional[TargetOutput]]:
    """The first root's logits from the pass that read the prompt's last token (``out``: the
    LM head over its last state where target.py drives the target, as models scale their
    logits their own ways). Where ``check`` (a row of a larger pass, which may choose
    otherwise) and the choice is too close to call, the last token is read again in a pass
    of its own, as plain decoding reads it: its logits then, and that pass's output."""
    def held(row: TargetOutput) -> mx.array:
        return decoder._held(lm_head(decoder.target, row.hidden[-1]) if decoder.drives_target else row.logits[-1])

    logits = held(out)
    if not (check and decoder._unsure(logits, len(prompt))):
        return logits, None
    keep_cache_entries(decoder.target_cache, len(prompt) - 1, [])
    decoder.rechecked += 1
    alone = decoder._forward(mx.array(prompt[-1:]), len(prompt) - 1, None)
    return held(alone), alone


def _chunk_read(decoder: SpeculativeDecoder, prompt: List[int], end: int, features: List[mx.array],
                hidden: List[mx.array]) -> Iterator[Tuple[int, int]]:
    """Yield the reading's progress once it has read the prompt up to ``end``. A
    reading stopped there (closed: its client left, or gave up waiting) keeps what the
    finished chunks hold: the caches hold ``prompt[:end]`` exactly as plain decoding's
    would, so they become a clean prefix, the drafter observing it as a prompt whose next
    token is ``prompt[end]``, and a retry of the prompt reads on from there."""
    try:
        yield end - decoder.reused, len(prompt) - decoder.reused
    except GeneratorExit:
        _keep_read(decoder, prompt, end, features, hidden)
        raise


def _keep_read(decoder: SpeculativeDecoder, prompt: List[int], end: int, features: List[mx.array],
               hidden: List[mx.array]) -> None:
    """A reading stopped with the caches holding ``prompt[:end]``: kept (_chunk_read)."""
    if end < len(prompt):  # (read whole, the last token's choice not made: nothing to keep)
        tokens = list(prompt[:end + 1])
        if decoder.drafter is not None and end > decoder.reused:  # (nothing read: nothing new to observe)
            states = TargetStates(mx.concatenate(features), mx.concatenate(hidden), decoder.taps) \
                if decoder.reads_states else None
            decoder.drafter.observe(Outcome(tokens, decoder.reused, states, from_prompt=True))
        decoder.state.settle(tokens)


def _model_pass(decoder: SpeculativeDecoder, tokens: mx.array, positions: int, mask: Mask) -> None:
    """``tokens`` read into the caches by the model's own forward pass, as mlx-lm reads a
    prompt (its logits never used; its positions and mask are the cache's and causal)."""
    decoder.forwards += 1
    decoder.target(tokens[None], cache=decoder.target_cache)


def _rides(decoder: SpeculativeDecoder, end: int, length: int) -> bool:
    """Whether a span of a ``length``-token prompt ending at ``end`` is read inside another's
    pass (_read_pass): where the decoder ``rides``, and the span leaves the last token to a
    pass of its own or the decoder drives its target."""
    return decoder.rides and (end < length or decoder.drives_target)


def _read_pass(decoder: SpeculativeDecoder, prompt: List[int], begin: int, end: int, features: List[mx.array],
               hidden: List[mx.array],
               alone: Callable[[SpeculativeDecoder, mx.array, int, Mask], Optional[TargetOutput]]) -> \
        Generator[PromptChunk, None, Optional[TargetOutput]]:
    """The target's pass over ``prompt[begin:end]``, appended to the caches: ``alone`` (given
    the decoder, the tokens, their first position and mask), or inside a batch's packed pass
    where the decoder ``rides`` and either the span leaves the prompt's last token (whose
    logits choose the first root) to a pass of its own, or the decoder drives its target
    (the root's logits are then its LM head over the pass's last hidden state, rechecked
    alone on a near-tie as a block's are: read_prompt). Then a PromptChunk
    is yielded and its ``out`` set before the reading resumes. Stopped there before the pass
    ran, the reading keeps what the caches hold, as between chunks; after a failed pass, it
    keeps nothing (the caches' state is unknown: left unfinished, nothing reuses them)."""
    tokens, mask = mx.array(prompt[begin:end]), "causal" if end - begin > 1 else None
    if not _rides(decoder, end, len(prompt)):
        return alone(decoder, tokens, begin, mask)
    offsets = [layer_cache.offset for layer_cache in decoder.target_cache]
    chunk = PromptChunk(Block(tokens, decoder.target_cache, begin, mask, decoder.taps or None, logits=False))
    try:
        yield chunk
    except GeneratorExit:
        if chunk.out is None and offsets == [layer_cache.offset for layer_cache in decoder.target_cache]:
            _keep_read(decoder, prompt, begin, features, hidden)
        raise
    if chunk.out is None:
        raise RuntimeError("a prompt's chunk was resumed before the pass that reads it ran")
    decoder.forwards += 1
    return chunk.out

def _spans(decoder: SpeculativeDecoder, end: int, chunk: int) -> Iterator[Tuple[int, int]]:
    """The (begin, end) spans of the prompt up to ``end`` read by one forward pass each,
    from what the caches hold: ``chunk`` tokens at a time, or ``decoder.read_chunk`` where
    it is set when a span begins (the scheduler sizes each pass to a time: any split reads
    the same text), cut where a copy of the caches is to be kept. With
    quantized KV caches, on plain mlx-lm's grid of ``chunk``, whose chunks decide where its
    cache turns."""
    begin, keep = decoder.reused, decoder.state.keep_at
    while begin < end:
        stop = (begin // chunk + 1) * chunk if decoder.kv is not None else begin + (decoder.read_chunk or chunk)
        stop = keep if begin < keep < stop else min(stop, end)
        yield begin, stop
        begin = stop


def batches(decoder: SpeculativeDecoder) -> bool:
    """Whether ``decoder``'s rounds can share a packed forward pass with others: its target
    is one packed_forward runs, its caches roll back by cutting (no recurrent state), and its
    target is whole on this machine."""
    return rounds_pack(decoder.target, decoder.target_cache, decoder.shards)


def rounds_pack(model: nn.Module, cache: List, shards: bool) -> bool:
    """Whether rounds over ``model`` with caches like ``cache`` can share a packed forward
    pass: packed_forward runs the model, the caches roll back by cutting (no recurrent
    state: rewind.py), and the model is whole on this machine."""
    return packs(model) and not needs_rewind(cache) and not shards


def batched_round(decoders: Sequence[SpeculativeDecoder], rooms: Sequence[int],
                  reading: Sequence[PromptChunk] = ()) -> List[Union[Round, Exception]]:
    """One round for several conversations of one target (each ``batches``): each drafts on
    its own, their blocks are verified in one packed forward pass (target.packed_forward),
    each accepts and commits its own, and their drafters observe together (observe_rows: a
    kind backed by a model reads every conversation in one pass). Each conversation's round
    is the one it would run alone, but for the last bits of the pass's products, whose
    greedy near-ties are decided by a one-row pass as a block's are. A conversation whose
    drafting, accepting or observing fails has its error in its place (its caches are left
    unfinished: nothing later reuses them), and the others' rounds are what they would be
    without it. ``reading``: new prompts' chunks read in the same pass (each chunk's ``out``
    set; the pass's failure raises, and ends every reading)."""
    results: List[Union[Round, Exception, None]] = [None] * len(decoders)
    drafted: List[Tuple[int, Drafted]] = []
    # Each drafts up to its cap: priced as if the others verified their roots (and unread
    # tokens) alone; then the pass keeps the nodes that pay across all rows (seat order
    # decides nothing). Priced without the prompts' chunks: they are sized to the rounds'
    # pass (scheduler.RIDE_SHARE), not the rounds to them.
    waiting = [1 + decoder.state.unread for decoder in decoders]
    for index, (decoder, room) in enumerate(zip(decoders, rooms)):
        try:
            drafted.append((index, decoder.draft(room, beside=(sum(waiting) - waiting[index], len(decoders)))))
        except Exception as error:
            results[index] = error
    if len(drafted) > 1:
        drafted = _chosen_across(decoders, drafted)
    if drafted or reading:
        with ExitStack() as stack:
            recorded = [stack.enter_context(decoders[i]._before_verify(d)) for i, d in drafted]
            outs = packed_forward(decoders[0].target, [decoders[i]._block(d.tree, d.tokens, d.unread)
                                                       for i, d in drafted] + [chunk.block for chunk in reading])
        for chunk, out in zip(reading, outs[len(drafted):]):
            chunk.out = out
        accepted: List[Tuple[int, Accepted]] = []
        for (index, round_drafted), out, rows in zip(drafted, outs, recorded):
            decoders[index].forwards += 1
            try:
                accepted.append((index, decoders[index].accept_round(round_drafted, out, rows)))
            except Exception as error:
                results[index] = error
        # The drafters observe together: a kind backed by a model reads every row in one pass.
        observing = [(index, done) for index, done in accepted if done.outcome is not None]
        errors = observe_rows([decoders[index].drafter for index, _ in observing],
                              [done.outcome for _, done in observing])
        failed = {index: error for (index, _), error in zip(observing, errors) if error is not None}
        for index, done in accepted:
            if index in failed:
                results[index] = failed[index]
                continue
            try:
                results[index] = decoders[index].settle_round(done)
                results[index].rows = len(drafted)
            except Exception as error:  # (a round's phase callback is the caller's code)
                results[index] = error
    return results


def _chosen_across(decoders: Sequence[SpeculativeDecoder], drafted: List[Tuple[int, Drafted]]) -> \
        List[Tuple[int, Drafted]]:
    """The rows' drafted trees cut to the nodes that pay across the pass
    (node_odds.choose_across), priced on this device's packed passes of as many rows
    (Costs.pass_ms) at the rows' mean context; a tree a grammar shaped is verified whole.
    Unmeasured costs: as drafted."""
    if decoders[drafted[0][0]]._costs_of is None:
        return drafted
    costs = decoders[drafted[0][0]]._measured()
    costs.measure_packed()  # (once per device and target: the first batch's round waits for it)
    free = [d.shaped is None and d.proposal is not None and len(d.tree) > 0 for _, d in drafted]
    drafted = [(index, replace(d, slots=slots(d.tree)) if cut else d) for (index, d), cut in zip(drafted, free)]
    chances = [decoders[index].odds.chances(d.tree, d.slots, d.proposal.confidence) if cut else []
               for (index, d), cut in zip(drafted, free)]
    verified = sum(1 + len(d.unread) + (0 if cut else len(d.tree)) for (_, d), cut in zip(drafted, free))
    attending = sum(len(d.committed) for _, d in drafted) // len(drafted)
    kept = choose_across(chances, verified, lambda tokens: costs.pass_ms(len(drafted), tokens, attending))
    return [(index, d.cut(keep) if cut and len(keep) < len(d.tree) else d)
            for (index, d), cut, keep in zip(drafted, free, kept)]
