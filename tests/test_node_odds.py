"""A batch's nodes chosen across its rows (node_odds.py, decoder.batched_round): ranked by
chance against the whole pass's cost, whatever the seat order; nothing verified where
nothing pays; every text still the target's own, and every drafter learning from what was
verified of its proposal."""

import itertools

import numpy as np
import pytest

from checkpoints import tiny_target, write_dspark
from drafting import decoder as make_decoder
from fixed_costs import CPU_COSTS
from mlx_eagle.costs import Costs
from mlx_eagle.decoder import Drafted, SpeculativeDecoder, batched_round
from mlx_eagle.drafters import Budget, Drafter, Outcome, Proposal
from mlx_eagle.drafters.composite import Composite
from mlx_eagle.drafters.dspark import DSparkDrafter, load as load_dspark
from mlx_eagle.drafters.eagle import EagleDrafter
from mlx_eagle.drafters.lookup import LookupDrafter
from mlx_eagle.heads import new_head
from mlx_eagle.node_odds import NodeOdds, choose_across, slots
from mlx_eagle.trees import DraftTree, parse_tree
from mlx_eagle.verify import Sampling
from plain import plain_tokens
from test_batch import PROMPTS, batched

CPU = Costs(CPU_COSTS.verify_ms).verify  # this CPU's curve: 16 tokens cost about 2.3 of one


def test_the_likeliest_nodes_of_any_row_are_verified_first_whatever_the_seat_order():
    rows = [[0.2, 0.1, 0.05], [0.95, 0.9, 0.85, 0.8], [0.6, 0.3]]
    chosen = choose_across(rows, 3, CPU)
    assert chosen[1] == [0, 1, 2, 3] and chosen[0] == []  # the sure row's whole chain; the weak one's nothing
    for order in itertools.permutations(range(3)):
        again = choose_across([rows[i] for i in order], 3, CPU)
        assert [again[order.index(i)] for i in range(3)] == chosen


def test_where_no_node_pays_the_pass_verifies_the_roots_alone():
    steep = lambda tokens: float(tokens)  # every token costs a whole step: no draft pays  # noqa: E731
    assert choose_across([[0.9, 0.8], [0.7]], 2, steep) == [[], []]
    assert choose_across([[0.9, 0.8], [0.7]], 2, lambda tokens: 1.0) == [[0, 1], [0]]  # free: every node


def test_a_childs_chance_never_passes_its_parents_so_kept_trees_stay_trees():
    odds = NodeOdds()
    tree = DraftTree([1, 2, 3, 4], [-1, 0, 0, 1], [1, 2, 2, 3])
    chances = odds.chances(tree, slots(tree))
    assert all(chances[child] <= chances[parent] for child, parent in enumerate(tree.parents) if parent >= 0)
    rows = [chances, [0.9 * c for c in chances]]
    for keep in choose_across(rows, 2, CPU):
        assert all(tree.parents[node] in keep + [-1] for node in keep)


def test_acceptance_by_depth_and_rank_is_learned_and_confidences_take_its_place():
    odds = NodeOdds()
    tree = DraftTree([1, 2, 3], [-1, -1, 0], [1, 1, 2])  # two first-depth siblings, a child of the first
    node_slots = slots(tree)
    assert node_slots == [(0, 0), (0, 1), (1, 0)]
    for round_ in range(200):  # the first sibling accepted 3 times in 4, its child every other time it was
        first = round_ % 4 != 0
        odds.record(node_slots, tree.parents, ([0] + ([2] if round_ % 2 else [])) if first else [])
    rates = odds.rates()
    assert abs(rates[0, 0] - 0.75) < 0.02 and rates[0, 1] < 0.02 and abs(rates[1, 0] - 2 / 3) < 0.03
    chances = odds.chances(tree, node_slots)
    assert abs(chances[2] - rates[0, 0] * rates[1, 0]) < 1e-9
    assert odds.chances(tree, node_slots, [0.5, 0.2, 0.4]) == pytest.approx([0.5, 0.2, 0.2])


def test_a_new_conversation_starts_from_what_its_plans_conversations_saw_accepted():
    """A conversation's odds shrink towards its plan's (every conversation's, recent ones
    weighing most), which learn from each of them: an agent's fresh turn whose earlier
    turns' drafts were all accepted prices its deep nodes as likely, not at the halving
    prior, and a plan whose drafts stopped being accepted forgets that."""
    plan = NodeOdds(decay=0.98)
    chain = DraftTree([1, 2, 3, 4], [-1, 0, 1, 2], [1, 2, 3, 4])
    node_slots = slots(chain)
    for _ in range(40):  # earlier conversations: every node accepted
        NodeOdds(prior=plan).record(node_slots, chain.parents, [0, 1, 2, 3])
    fresh, alone = NodeOdds(prior=plan), NodeOdds()
    assert fresh.chances(chain, node_slots)[3] > 0.8 > 0.1 > alone.chances(chain, node_slots)[3]
    for _ in range(3):  # its own rounds: none accepted; it learns, and so does the plan
        fresh.record(node_slots, chain.parents, [])
    assert fresh.rates()[0, 0] < 0.5 and plan.rates()[0, 0] < 0.99
    for _ in range(300):
        NodeOdds(prior=plan).record(node_slots, chain.parents, [])
    assert plan.rates()[0, 0] < 0.05  # (recent trees weigh most)


class Fixed(Drafter):
    """Proposes ``tokens`` as a chain every round; keeps what it observes."""

    def __init__(self, tokens):
        self.tokens, self.seen = tokens, []

    def propose(self, budget):
        return Proposal.chain(self.tokens)

    def observe(self, outcome):
        self.seen.append(outcome)


def test_each_source_of_a_merged_tree_learns_what_the_batch_verified_of_its_own_part():
    first, second = Fixed([1, 2, 3]), Fixed([1, 5])
    composite = Composite([first, second], ["first", "second"])
    merged = composite.propose(Budget(room=8, nodes=16))
    assert merged.tree.tokens == [1, 2, 3, 5] and merged.tree.parents == [-1, 0, 1, 0]
    kept = [0, 1, 3]  # the batch dropped the first's last draft
    verified = merged.only(kept)
    composite.observe(Outcome([7, 1, 2, 8], 0, None, verified, path=[0, 1], kept=kept))
    (mine,), (theirs,) = first.seen, second.seen
    assert mine.proposal.tree.tokens == [1, 2] and mine.path == [0, 1] and mine.kept == [0, 1]
    assert theirs.proposal.tree.tokens == [1, 5] and theirs.path == [0] and theirs.kept == [0, 1]
    statistics = composite.statistics()
    assert (statistics["first"].proposed, statistics["first"].accepted) == (2, 2)
    assert (statistics["second"].proposed, statistics["second"].accepted) == (1, 0)
    composite.propose(Budget(room=8, nodes=16))
    composite.observe(Outcome([7, 1, 9], 0, None, merged.only([]), path=[], kept=[]))  # the batch kept none
    assert [len(source.seen[-1].proposal) for source in (first, second)] == [0, 0]
    assert all(source.seen[-1].kept == [] for source in (first, second))


def test_greedy_rows_cut_across_the_batch_are_each_the_reply_alone(tmp_path, monkeypatch):
    """Rows drafting EAGLE-3 trees with context lookup (chances learned by depth and rank)
    beside rows drafting DSpark chains (its confidences), priced on this CPU's curve: the
    pass cuts some rows' trees, and every reply is plain decoding's."""
    model = tiny_target(0)
    counts = [40, 12, 33, 25]
    write_dspark(tmp_path / "dspark", model, [1, 3])
    dspark = load_dspark(tmp_path / "dspark", model)
    costs = lambda: Costs(CPU_COSTS.verify_ms)  # noqa: E731
    cuts = []
    cut = Drafted.cut
    monkeypatch.setattr(Drafted, "cut", lambda self, keep: cuts.append((len(self.tree), len(keep))) or cut(self, keep))

    def decoder(index):
        if index % 2:
            return SpeculativeDecoder(model, DSparkDrafter(dspark, model, CPU_COSTS.at()), Sampling(), costs=costs)
        head = new_head(model, "eagle3", draft_vocab_size=64, seed=index)
        return make_decoder(model, head, "static:default", Sampling(), lookup=LookupDrafter(CPU_COSTS.at()),
                            costs=costs)

    decoders = [decoder(index) for index in range(len(PROMPTS))]
    replies = batched(decoders, PROMPTS, counts)
    assert replies == [plain_tokens(model, prompt, count) for prompt, count in zip(PROMPTS, counts)]
    assert cuts and any(kept < drafted for drafted, kept in cuts)  # the batch did cut trees
    assert all(np.isfinite(d.odds.rates()).all() for d in decoders)


def test_a_round_of_rows_with_nothing_worth_verifying_is_plain_batching():
    """A curve on which no draft pays (every token a whole step): every row proposes, the
    pass verifies the roots alone, and the text is still the target's."""
    model = tiny_target(0)
    linear = lambda: Costs({1: 10.0, 2: 20.0, 4: 40.0, 16: 160.0})  # noqa: E731
    decoders = [SpeculativeDecoder(model, Fixed([1, 2, 3]), Sampling(), costs=linear) for _ in PROMPTS]
    counts = [9, 9, 9, 9]
    replies = [[decoder.prefill(prompt)] for decoder, prompt in zip(decoders, PROMPTS)]
    for _ in range(counts[0] - 1):
        for reply, result in zip(replies, batched_round(decoders, [20] * len(decoders))):
            assert result.drafted == 0 and len(result.tokens) == 1
            reply += result.tokens
    assert replies == [plain_tokens(model, prompt, count) for prompt, count in zip(PROMPTS, counts)]
    # each drafter hears that it proposed and none of it was verified (an EAGLE head then holds back)
    assert all(d.drafter.seen[-1].proposal is not None and not d.drafter.seen[-1].proposal for d in decoders)


def test_an_eagle_head_whose_trees_the_pass_keeps_cutting_holds_back():
    """Heads whose own prices say their trees pay (2 of 10 nodes accepted a round, as if
    alone), in a batch whose learned odds say none of their nodes will be accepted: every
    round verifies the roots alone, the text is the target's, and the heads hold back,
    rather than grow trees no pass verifies (fails where a tree cut to nothing counts as
    no nodes: its yield and its size then fade together, and its own price keeps saying
    it pays)."""
    model = tiny_target(0)
    costs = lambda: Costs(CPU_COSTS.verify_ms)  # noqa: E731
    spec = parse_tree("static:default")
    decoders = [SpeculativeDecoder(model, EagleDrafter(new_head(model, "eagle3", draft_vocab_size=64, seed=index),
                                                       model, spec, CPU_COSTS.at()), Sampling(), costs=costs)
                for index in range(len(PROMPTS))]
    count = 40
    replies = [[decoder.prefill(prompt)] for decoder, prompt in zip(decoders, PROMPTS)]
    for decoder in decoders:
        decoder.drafter.rounds, decoder.drafter.accepted, decoder.drafter.nodes = 20, 2.0, 10.0
        decoder.odds.tried[:], decoder.odds.accepted[:] = 1000, 0  # none of its nodes accepted, ever
    while min(map(len, replies)) < count:
        results = batched_round(decoders, [count + 1] * len(decoders))
        assert sum(result.drafted for result in results) == 0
        for reply, result in zip(replies, results):
            reply += result.tokens
    assert [reply[:count] for reply in replies] == [plain_tokens(model, prompt, count) for prompt in PROMPTS]
    assert all(d.drafter.held > 0 for d in decoders)  # held back: no trees grown for nothing


def test_a_packed_pass_is_priced_by_its_rows_and_tokens():
    """Rows dearer than tokens (each attends in a call of its own): a pass over 16 rows costs
    what was timed for 16 rows, not a one-row forward over 16 tokens; between and past the
    timed shapes, along lines; a node beside 15 rows then costs fewer plain batched steps."""
    packed = {2: {1: 12.0, 3: 16.0}, 4: {1: 16.0, 3: 24.0}, 8: {1: 24.0, 3: 40.0}, 16: {1: 40.0, 3: 72.0}}
    costs = Costs({1: 10.0, 2: 10.5, 16: 14.0, 32: 22.0}, packed_ms=packed)
    assert costs.pass_ms(1, 5) == costs.verify(5)
    assert costs.pass_ms(16, 16) == 40.0 and costs.pass_ms(16, 48) == 72.0 and costs.pass_ms(16, 32) == 56.0
    assert costs.pass_ms(12, 12) == 32.0 and costs.pass_ms(32, 32) == 72.0  # between; past, along the rows
    one_row = Costs(costs.verify_ms)
    beside = (15, 16)
    assert costs.at(beside=beside)(4) < one_row.at(beside=beside)(4)
