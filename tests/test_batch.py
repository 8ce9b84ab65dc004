"""Several conversations in one forward pass (target.packed_forward, decoder.batched_round,
scheduler.batch_generate): each conversation's reply is exactly the one it gets alone, the
same tokens when greedy and the same distribution when sampling, whatever else shares the
pass, with prompts of different lengths and conversations that end at different rounds."""

from pathlib import Path

import numpy as np
import pytest

from checkpoints import tiny_target, write_dspark
from drafting import decoder as make_decoder, swap_close_calls
from mlx_eagle import batch_generate
from mlx_eagle.decoder import SpeculativeDecoder, batched_round, batches
from mlx_eagle.drafters.composite import Composite
from mlx_eagle.drafters.draft_model import DraftModelDrafter
from mlx_eagle.drafters.dspark import DSparkDrafter, load as load_dspark
from mlx_eagle.drafters.lookup import LookupDrafter
from mlx_eagle.heads import new_head
from mlx_eagle.replies import chat_tokens
from mlx_eagle.verify import Sampling
from oracle import FixedDraft
from plain import plain_tokens
from sampling_checks import PROMPT, SAMPLES, TREE, VOCAB, chi_square_ok, exact_joint

PROMPTS = [[5, 17, 33, 5, 17, 60, 2, 9, 41, 17, 5, 17, 33], [1, 2, 3, 1, 2, 3, 1, 2], [9, 8, 7, 6, 5, 9, 8, 7, 6],
           [44, 45, 46, 47, 44, 45]]


def batched(decoders, prompts, counts):
    """Each decoder's first ``counts`` tokens after its prompt, its rounds in one pass with
    the others' until it has them (the others going on without it)."""
    replies = [[decoder.prefill(prompt)] for decoder, prompt in zip(decoders, prompts)]
    while active := [i for i, reply in enumerate(replies) if len(reply) < counts[i]]:
        rounds = batched_round([decoders[i] for i in active], [counts[i] - len(replies[i]) for i in active])
        for i, result in zip(active, rounds):
            replies[i] += result.tokens
    return [reply[:count] for reply, count in zip(replies, counts)]


@pytest.mark.parametrize("drafting", ["context lookup", "a random EAGLE-3 head's trees", "an EAGLE-1 head's chains",
                                      "one EAGLE-3 head drafting every conversation's trees together",
                                      "a random DSpark drafter's chains, cut by its confidences",
                                      "one draft model drafting every conversation's chains together"])
def test_greedy_replies_in_one_pass_are_each_the_reply_alone(drafting, tmp_path):
    """Prompts of different lengths, replies of different lengths (so conversations leave
    the batch at different rounds), trees and chains, heads reading states at taps."""
    model = tiny_target(0)
    counts = [40, 12, 33, 25]
    shared = new_head(model, "eagle3", draft_vocab_size=64)  # one head: every row drafted in one pass a depth
    small = tiny_target(1)  # one draft model: likewise

    def decoder(index):
        if drafting == "context lookup":
            return SpeculativeDecoder(model, LookupDrafter(lambda k: 1.0), Sampling())
        if "draft model" in drafting:
            return SpeculativeDecoder(model, Composite([DraftModelDrafter(small, lambda k: 1.0, 0.0, max_tokens=4),
                                                        LookupDrafter(lambda k: 1.0)]), Sampling())
        if "DSpark" in drafting:
            directory = tmp_path / "dspark"
            if not directory.exists():
                write_dspark(directory, model, [1, 3])
            return SpeculativeDecoder(model, Composite([DSparkDrafter(load_dspark(directory, model), model,
                                                                      lambda k: 1.0 + 0.1 * (k - 1)),
                                                        LookupDrafter(lambda k: 1.0)]), Sampling())
        family, tree = ("eagle3", "static:default") if "EAGLE-3" in drafting else ("eagle1", "chain:3")
        head = shared if "together" in drafting else \
            new_head(model, family, draft_vocab_size=64 if family == "eagle3" else None, seed=index)
        return make_decoder(model, head, tree, Sampling(), lookup=LookupDrafter(lambda k: 1.0))

    decoders = [decoder(index) for index in range(len(PROMPTS))]
    assert all(batches(d) for d in decoders)
    replies = batched(decoders, PROMPTS, counts)
    assert replies == [plain_tokens(model, prompt, count) for prompt, count in zip(PROMPTS, counts)]
    assert decoders[0].forwards < sum(counts) / 2  # rounds were shared: far fewer passes than tokens


def test_sampling_in_a_batch_follows_the_target_distribution(six_token_model):
    """The first three tokens of a conversation that shares every pass with another (its
    own drafts accepted part of the time), over many seeds: the target's exact joint
    distribution, by chi-square; its draws are its own, whatever the other row draws."""
    sampling = Sampling(temp=0.7, top_p=0.9, top_k=4, min_p=0.05)
    joint = exact_joint(six_token_model, sampling)
    likely = list(np.argsort(-joint.sum(axis=(0, 2))))
    counts, accepted = np.zeros((VOCAB,) * 3), 0
    for seed in range(SAMPLES):
        ours = make_decoder(six_token_model, FixedDraft(likely, VOCAB), TREE, sampling, seed=seed)
        other = make_decoder(six_token_model, FixedDraft(likely[::-1], VOCAB), TREE, sampling, seed=seed + SAMPLES)
        tokens, _ = batched([ours, other], [PROMPT, [3, 3, 0, 5]], [3, 4])
        counts[tuple(tokens)] += 1
        accepted += ours.forwards < 3
    assert chi_square_ok(counts, joint)
    assert accepted > SAMPLES / 4  # its drafts were accepted: rounds produced several tokens
    assert not chi_square_ok(counts, exact_joint(six_token_model, Sampling(temp=0.8, top_p=0.9, top_k=4,
                                                                                min_p=0.05)))


def test_batch_generate_gives_each_prompt_its_own_reply_on_the_default_model(smollm):
    """SmolLM2 with its shipped head and context drafts, as a user calls batch_generate:
    every text is plain mlx-lm's for that prompt alone."""
    model, tokenizer = smollm
    texts = ["What is the capital of France?", "Repeat exactly: The quick brown fox jumps over the lazy dog.",
             "Write a haiku about the sea.", "Fix the typo: def greet(nme): print('Hello ' + name)"]
    prompts = [chat_tokens(tokenizer, [{"role": "user", "content": text}]) for text in texts]
    response = batch_generate(model, tokenizer, prompts, max_tokens=32)
    for prompt, ids, text in zip(prompts, response.token_ids, response.texts):
        expected = [t for t in plain_tokens(model, prompt, 32, tokenizer.eos_token_ids)
                    if t not in tokenizer.eos_token_ids]
        assert ids == expected and text == tokenizer.decode(expected)
    assert response.tokens_per_forward > 2.0  # four conversations' tokens in each pass


@pytest.mark.slow  # the real model
def test_a_reply_that_fails_in_batch_generate_ends_alone(smollm, monkeypatch):
    """One of three replies fails at its third round (a fault in taking that round): it ends
    there, with its error and the text it had, plain decoding's as far as it went; the other
    two run to their end, each plain decoding's."""
    from mlx_eagle.generation import Generation

    model, tokenizer = smollm
    texts = ["What is the capital of France?", "Write a haiku about the sea.", "Count from one to ten."]
    prompts = [chat_tokens(tokenizer, [{"role": "user", "content": text}]) for text in texts]
    conclude = Generation.conclude

    def failing(self, result):
        if self.ids == prompts[1] and self.rounds == 2:
            raise RuntimeError("a fault in this reply alone")
        return conclude(self, result)

    monkeypatch.setattr(Generation, "conclude", failing)
    response = batch_generate(model, tokenizer, prompts, max_tokens=24)
    assert [type(error).__name__ for error in response.errors] == ["NoneType", "RuntimeError", "NoneType"]
    for index, prompt in enumerate(prompts):
        ends = tokenizer.eos_token_ids
        plain = [t for t in plain_tokens(model, prompt, 24, ends) if t not in ends]
        shown = response.token_ids[index]
        assert shown == plain[:len(shown)] and (0 < len(shown) < len(plain) if index == 1 else shown == plain)


@pytest.mark.parametrize("seed", range(4))
def test_conversations_joining_and_leaving_between_rounds_each_get_their_own_reply(seed):
    """Random arrivals (a prompt read between two rounds of the others), random lengths,
    conversations that leave early (their reply cut off, the others going on), and a mix of
    drafters (context lookup, a random EAGLE-3 head's trees, an EAGLE-1 head's chains, none):
    every reply that completes is plain decoding's for its prompt alone, and every one that
    leaves early is plain decoding's as far as it went."""
    import random

    rng = random.Random(seed)
    model = tiny_target(0)

    def new_decoder():
        kind = rng.choice(["lookup", "eagle3", "eagle1", "none"])
        lookup = LookupDrafter(lambda k: 1.0)
        if kind == "none":
            return SpeculativeDecoder(model, None, Sampling())
        if kind == "lookup":
            return SpeculativeDecoder(model, lookup, Sampling())
        head = new_head(model, kind, draft_vocab_size=64 if kind == "eagle3" else None, seed=rng.randrange(100))
        return make_decoder(model, head, "static:default" if kind == "eagle3" else "chain:3", Sampling(),
                            lookup=lookup if rng.random() < 0.5 else None)

    waiting = [([rng.randrange(1, 97) for _ in range(rng.randrange(2, 30))], rng.randrange(1, 40))
               for _ in range(8)]
    active, finished = [], []  # (decoder, prompt, wanted, reply, leaves_after)
    while waiting or active:
        while waiting and (not active or rng.random() < 0.4):  # arrivals between rounds
            prompt, wanted = waiting.pop()
            decoder = new_decoder()
            active.append((decoder, prompt, wanted, [decoder.prefill(prompt)],
                           rng.randrange(1, 40) if rng.random() < 0.3 else None))
        rows = [row for row in active if len(row[3]) < row[2] and (row[4] is None or len(row[3]) < row[4])]
        if rows:
            rounds = batched_round([row[0] for row in rows], [row[2] - len(row[3]) for row in rows])
            for row, result in zip(rows, rounds):
                row[3].extend(result.tokens)
        for row in list(active):
            if len(row[3]) >= row[2] or (row[4] is not None and len(row[3]) >= row[4]):
                active.remove(row)
                finished.append(row)
    for _, prompt, wanted, reply, leaves_after in finished:
        shown = min(wanted, leaves_after or wanted)
        assert reply[:shown] == plain_tokens(model, prompt, shown), (prompt, wanted, leaves_after)


@pytest.mark.slow  # the real model
def test_near_ties_in_a_packed_pass_are_decided_as_each_alone(smollm, monkeypatch):
    """The packed pass's logits perturbed as its larger products' rounding might: wherever
    a row's top two lie within the tolerance they are swapped. Each conversation's greedy
    reply is still plain decoding's, because such positions are read again alone; without
    the rule it changes."""
    import mlx_eagle.decoder as decoder_module

    model, tokenizer = smollm
    prompts = [chat_tokens(tokenizer, [{"role": "user", "content": question}]) for question in (
        "Name three rivers of Europe.", "Write a haiku about rain.")]
    expected = [plain_tokens(model, prompt, 16) for prompt in prompts]
    packed = decoder_module.packed_forward

    def perturbed(target, blocks):
        return [decoder_module.TargetOutput(swap_close_calls(out.logits, 1.0), out.features, out.hidden)
                for out in packed(target, blocks)]

    monkeypatch.setattr(decoder_module, "packed_forward", perturbed)

    def decode(tolerance):
        decoders = [make_decoder(model, new_head(model, "eagle3", seed=index), "static:default", Sampling(),
                                 lookup=LookupDrafter(lambda k: 1.0)) for index in range(len(prompts))]
        for decoder in decoders:
            decoder.tolerance = tolerance
        return batched(decoders, prompts, [16] * len(prompts)), sum(d.rechecked for d in decoders)

    replies, rechecked = decode(1.0)
    assert replies == expected and rechecked > 0
    assert decode(0.0)[0] != expected, "the perturbation flips a choice when nothing rechecks it"


def test_one_head_drafts_every_conversation_together_as_each_alone(smollm, monkeypatch):
    """SmolLM2's shipped head drafting four conversations of different lengths, as a batched
    round's drafters observe (EagleDrafter.observe_together): one head pass reads every
    conversation's new tokens and one a depth grows all the trees, and each conversation's
    tree is the one it grows alone (but where products over more rows round a near-tie
    the other way), its cache left as alone, after a prompt and after a round."""
    import copy

    import mlx.core as mx

    from mlx_eagle.drafters import Outcome, TargetStates, observe_rows
    from mlx_eagle.drafters.eagle import EagleDrafter, shipped
    from mlx_eagle.target import make_cache, target_forward
    from mlx_eagle.trees import parse_tree

    model, tokenizer = smollm
    head = shipped(model)
    texts = ["def fib(n):\n    return", "The capital of France is", "Once upon a time there was a little",
             "Write a haiku about the sea."]
    drafters = [EagleDrafter(head, model, parse_tree("static:default")) for _ in texts]
    taps = drafters[0].taps
    caches = [make_cache(model) for _ in texts]
    committed = [tokenizer.encode(text) for text in texts]

    def advance(new):
        """Each conversation's next ``new`` greedy tokens, read by the target one pass each:
        the outcomes its drafter observes."""
        outcomes = []
        for tokens, cache in zip(committed, caches):
            start, features, hidden = cache[0].offset, [], []
            for _ in range(new):
                read = tokens[cache[0].offset:]
                out = target_forward(model, mx.array([read]), cache, cache[0].offset,
                                     "causal" if len(read) > 1 else None, taps)
                features.append(out.features[0])
                hidden.append(out.hidden[0])
                tokens.append(int(mx.argmax(out.logits[0, -1])))
            states = TargetStates(mx.concatenate(features), mx.concatenate(hidden), taps)
            outcomes.append(Outcome(list(tokens), start, states, from_prompt=start == 0))
        return outcomes

    passes = []
    step = type(head).step
    monkeypatch.setattr(type(head), "step", lambda self, *args: passes.append(1) or step(self, *args))
    for new in (1, 3):  # the prompts, then a round that committed three tokens
        outcomes = advance(new)
        alone = []
        for drafter, outcome in zip(drafters, outcomes):
            twin = copy.copy(drafter)
            twin.cache = copy.deepcopy(drafter.cache)
            twin.observe(outcome)
            alone.append((twin.queued.tokens.tolist(), twin.cache[0].offset))
        passes.clear()
        assert observe_rows(drafters, outcomes) == [None] * len(texts)
        assert len(passes) == 1 + sum(level.grows for level in drafters[0].grower.levels)  # not one per row
        together = [(d.queued.tokens.tolist(), d.cache[0].offset) for d in drafters]
        assert [offset for _, offset in together] == [offset for _, offset in alone]
        same = sum(a == b for (mine, _), (theirs, _) in zip(together, alone) for a, b in zip(mine, theirs))
        assert same >= 0.95 * sum(len(theirs) for theirs, _ in alone)  # (identical on this machine)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_block_drafters_draft_every_conversation_together_as_each_alone(kind, tmp_path, monkeypatch):
    """Four conversations of different lengths sharing one random block drafter, observing
    a batched round's outcomes together (DFlashDrafter.observe_together): one pass reads
    every conversation's new states and one drafts all their blocks, and each block is the
    one it drafts alone, its context cache as alone, after a prompt and after a round."""
    import copy

    import mlx.core as mx

    from checkpoints import write_dflash
    from mlx_eagle.dflash_model import DFlashModel
    from mlx_eagle.drafters import Outcome, TargetStates, observe_rows
    from mlx_eagle.drafters import dflash, dspark
    from mlx_eagle.target import make_cache, target_forward

    model = tiny_target(0)
    (write_dflash if kind == "dflash" else write_dspark)(tmp_path / kind, model, [1, 3])
    module = dflash if kind == "dflash" else dspark
    drafted_with = module.load(tmp_path / kind, model)
    drafters = [module.DFlashDrafter(drafted_with, model, lambda k: 1.0) if kind == "dflash" else
                module.DSparkDrafter(drafted_with, model, lambda k: 1.0) for _ in PROMPTS]
    taps, caches, committed = drafters[0].taps, [make_cache(model) for _ in PROMPTS], [list(p) for p in PROMPTS]
    passes = []
    blocks_states = DFlashModel.blocks_states
    monkeypatch.setattr(DFlashModel, "blocks_states", lambda self, *a: passes.append(1) or blocks_states(self, *a))
    for new in (1, 3):  # the prompts, then a round that committed three tokens
        outcomes = []
        for tokens, cache in zip(committed, caches):
            start, features = cache[0].offset, []
            for _ in range(new):
                read = tokens[cache[0].offset:]
                out = target_forward(model, mx.array([read]), cache, cache[0].offset,
                                     "causal" if len(read) > 1 else None, taps)
                features.append(out.features[0])
                tokens.append(int(mx.argmax(out.logits[0, -1])))
            outcomes.append(Outcome(list(tokens), start, TargetStates(mx.concatenate(features), None, taps),
                                    from_prompt=start == 0))
        alone = []
        for drafter, outcome in zip(drafters, outcomes):
            twin = copy.copy(drafter)
            twin.cache = copy.deepcopy(drafter.cache)
            twin.observe(outcome)
            alone.append(([np.array(part).tolist() for part in twin.block if part is not None], twin.cache[0].offset))
        passes.clear()
        assert observe_rows(drafters, outcomes) == [None] * len(PROMPTS)
        assert len(passes) == 1  # one pass drafts every conversation's block
        together = [([np.array(part).tolist() for part in d.block if part is not None], d.cache[0].offset)
                    for d in drafters]
        assert [offset for _, offset in together] == [offset for _, offset in alone]
        assert [block[0] for block, _ in together] == [block[0] for block, _ in alone]  # the same drafts
        for (mine, _), (theirs, _) in zip(together, alone):
            assert np.allclose(mine[1], theirs[1], atol=1e-4)  # log-probabilities or confidences


def test_one_draft_model_drafts_every_conversation_together_as_each_alone(smollm, monkeypatch):
    """SmolLM2 as the draft model of four conversations whose chains differ in length, as a
    batched round's drafters observe (DraftModelDrafter.observe_together): one packed pass
    of the draft model reads every conversation's new tokens and one a depth drafts every
    chain still growing, and each chain is the one drafted alone, its cache left as alone,
    after a prompt and after a round."""
    import mlx.core as mx

    from mlx_eagle.drafters import Outcome, observe_rows
    from mlx_eagle.drafters import draft_model

    model, tokenizer = smollm
    texts = ["def fib(n):\n    return", "The capital of France is", "Once upon a time there was a little",
             "Write a haiku about the sea."]
    lengths = [2, 3, 4, 5]  # (a flat price: each drafts as long as it may)
    drafters = [DraftModelDrafter(model, lambda k: 1.0, 0.0, max_tokens=n) for n in lengths]
    committed = [tokenizer.encode(text) for text in texts]
    passes = []
    packed = draft_model.packed_forward
    monkeypatch.setattr(draft_model, "packed_forward", lambda *a: passes.append(len(a[1])) or packed(*a))
    for new in (1, 3):  # the prompts, then a round that committed three tokens
        outcomes = []
        for tokens in committed:
            start = len(tokens) - 1 if new > 1 else 0
            for _ in range(new):
                tokens.append(int(mx.argmax(model(mx.array([tokens]))[0, -1])))
            outcomes.append(Outcome(list(tokens), start, from_prompt=new == 1))
        alone = []
        for drafter, outcome in zip(drafters, outcomes):
            twin = drafter.branch()
            twin.observe(outcome)
            alone.append((twin.queued[0].tolist(), twin.cache[0].offset))
        passes.clear()
        assert observe_rows(drafters, outcomes) == [None] * len(texts)
        assert passes == [4, 4, 3, 2]  # the reads, then each depth's rows drafting together; the last alone
        together = [(d.queued[0].tolist(), d.cache[0].offset) for d in drafters]
        assert [offset for _, offset in together] == [offset for _, offset in alone]
        assert [len(chain) for chain, _ in together] == lengths
        same = sum(a == b for (mine, _), (theirs, _) in zip(together, alone) for a, b in zip(mine, theirs))
        assert same >= 0.95 * sum(lengths)  # (identical on this machine)


def test_a_prompt_read_in_passes_of_its_own_is_sized_past_the_pass_floor():
    """scheduler.chunk_for: passes of a floor plus a time per token, the chunk that fills
    the bound past the floor; where the floor passes half the bound, a pass of twice the
    floor, not the token or two that sizing by pace alone shrank to (a large model on a slow
    device read its prompt several times slower)."""
    from mlx_eagle.scheduler import chunk_for

    def passes(floor, per_token, sizes):
        return [(n, floor + per_token * n) for n in sizes]

    assert chunk_for(0.5, []) is None
    assert chunk_for(0.5, passes(0.1, 0.01, [64])) == int(0.5 / (0.74 / 64))  # one size: in proportion
    assert abs(chunk_for(0.5, passes(0.1, 0.01, [64, 30, 45])) - 40) <= 1  # (0.5 - 0.1) / 0.01
    assert abs(chunk_for(0.5, passes(0.7, 0.02, [64, 20, 5])) - 35) <= 1  # floor 0.7 past the bound: 0.7 / 0.02
    assert chunk_for(0.5, [(64, 0.9), (32, 0.95)]) == int(0.5 / (1.85 / 96))  # noise: in proportion
    assert chunk_for(float("inf"), passes(0.1, 0.01, [64, 30])) == 512  # no bound: PROMPT_TOKENS_PER_TURN


def test_a_prompt_riding_a_pass_gets_a_share_its_whole_rest_or_its_last_step():
    """Scheduler._ride_chunk: a long prompt's chunk adds RIDE_SHARE of the rounds' pass; a
    rest that adds at most a pass's time rides whole; another chunk's share taken, none
    this turn; and a reading with every token read (an EAGLE head's reading yields that
    before it chooses the first token) still gets its step: it once waited for ever for a
    chunk of nothing (benchmarks/riding_prompts.py found it). A new prompt's first chunk is
    sized at the pace the last prompt rode at. Where prompts outnumber the replies decoding,
    their share grows with them (ride_share): one reply beside seven prompts once read an
    agent's turn 8 tokens a pass."""
    import queue
    import threading

    from mlx_eagle.scheduler import FIRST_RIDE, RIDE_SHARE, ReplyJob, Scheduler, ride_share

    scheduler = Scheduler(queue.Queue(), 4, 4)
    scheduler.decode_seconds = 0.2
    request = ReplyJob([1, 2, 3], lambda slot: None, threading.Event())
    request.pace, request.unread = 100.0, 4000  # tokens a second inside a pass; left to read
    assert scheduler._ride_chunk(request, 0.5, 0.0, RIDE_SHARE) == int(100.0 * RIDE_SHARE * 0.2)
    assert scheduler._ride_chunk(request, 0.5, RIDE_SHARE * 0.2, RIDE_SHARE) == 0
    request.unread = 40
    assert scheduler._ride_chunk(request, 0.5, 0.0, RIDE_SHARE) == 40
    request.unread = 0
    assert scheduler._ride_chunk(request, 0.5, 0.0, RIDE_SHARE) == 1
    # A new prompt, its pace not known: FIRST_RIDE tokens until a prompt has ridden, then
    # sized at that one's pace, its whole length as its rest (a short one rides whole at once).
    short, long = (ReplyJob(list(range(n)), lambda slot: None, threading.Event()) for n in (30, 4000))
    assert scheduler._ride_chunk(short, 0.5, 0.0, RIDE_SHARE) == FIRST_RIDE
    scheduler.ride_pace = 100.0
    assert scheduler._ride_chunk(short, 0.5, 0.0, RIDE_SHARE) == 30
    assert scheduler._ride_chunk(long, 0.5, 0.0, RIDE_SHARE) == int(100.0 * RIDE_SHARE * 0.2)
    assert ride_share(1, 4) == ride_share(4, 4) == RIDE_SHARE  # a long prompt beside replies: bounded
    assert ride_share(7, 1) == 7 * RIDE_SHARE and ride_share(6, 3) == 2 * RIDE_SHARE
    assert ride_share(3, 0) == 0.0  # no pass to ride
    assert scheduler._ride_chunk(long, 0.5, 0.0, ride_share(7, 1)) == int(100.0 * 7 * RIDE_SHARE * 0.2)


@pytest.mark.parametrize("drafting", ["SmolLM2's shipped head (the reading keeps its states)",
                                      "context lookup (no states read)"])
def test_a_prompt_read_inside_the_rounds_passes_gives_the_reply_alone(drafting, smollm):
    """A long prompt read in chunks inside the packed passes of two replies decoding
    (decoder.rides: read_prompt yields each chunk, batched_round reads it beside the
    rounds), then decoding beside them: all three replies are plain decoding's, and the
    chunks did ride. A reading stopped at a chunk before its pass ran keeps what it had
    read, as between chunks. With the head, the prompt's last chunk rides as well: no pass of
    its own at all."""
    from mlx_eagle.decoder import PromptChunk
    from mlx_eagle.drafters.eagle import shipped

    model, tokenizer = smollm
    prompts = [chat_tokens(tokenizer, [{"role": "user", "content": question}]) for question in (
        "Name three rivers of Europe.", "Write a haiku about rain.")]
    import mlx_eagle.verify

    long_prompt = tokenizer.encode(Path(mlx_eagle.verify.__file__).read_text())[:600]  # (text a reply depends on)
    counts = [40, 40, 12]

    def make():
        if "lookup" in drafting:
            return SpeculativeDecoder(model, LookupDrafter(lambda k: 1.0), Sampling())
        return make_decoder(model, shipped(model), "static:default", Sampling(), lookup=LookupDrafter(lambda k: 1.0))

    decoders = [make() for _ in range(3)]
    replies = [[decoder.prefill(prompt)] for decoder, prompt in zip(decoders[:2], prompts)]
    reader = decoders[2]
    reader.rides, reader.read_chunk = True, 96
    reading, rode = reader.reading(long_prompt), 0
    for step in reading:
        if isinstance(step, PromptChunk):
            rode += 1
            for reply, result in zip(replies, batched_round(decoders[:2], [80] * 2, [step])):
                reply += result.tokens
    assert rode >= 4 and all(len(reply) > 5 for reply in replies)
    # Its last chunk rode too, the reader driving its target (its root's logits are the LM head
    # over that pass's last state): no pass of its own but to recheck a near tie.
    assert reader.forwards == rode + reader.rechecked
    replies.append([reader.root])
    while active := [i for i, reply in enumerate(replies) if len(reply) < counts[i]]:
        for i, result in zip(active, batched_round([decoders[i] for i in active],
                                                   [counts[i] - len(replies[i]) for i in active])):
            replies[i] += result.tokens
    expected = [plain_tokens(model, prompt, count) for prompt, count in zip(prompts + [long_prompt], counts)]
    assert [reply[:count] for reply, count in zip(replies, counts)] == expected

    unsure = make()  # every choice too close to call: the last token is read again alone
    unsure.rides, unsure.read_chunk, unsure.tolerance = True, 1000, float("inf")
    for step in unsure.reading(long_prompt):
        if isinstance(step, PromptChunk):
            batched_round(decoders[:1], [1], [step])
    assert unsure.rechecked == 1 and unsure.root == expected[2][0]

    stopped = make()
    stopped.rides, stopped.read_chunk = True, 96
    reading = stopped.reading(long_prompt)
    assert next(reading) == (0, len(long_prompt))
    batched_round(decoders[:1], [80], [next(reading)])  # the first chunk read in a pass
    assert next(reading) == (96, len(long_prompt))
    assert isinstance(next(reading), PromptChunk)
    reading.close()  # stopped before the second chunk's pass
    stopped.rides = False
    assert stopped.prefill(long_prompt) == expected[2][0] and stopped.reused == 96
