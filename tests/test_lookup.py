"""Drafting from the context: the n-gram index, the adaptive draft length, grafting
onto head trees, and lossless decoding with lookup drafts on the real SmolLM2 (alone
and merged with each head family and tree kind) and on an architecture the tree path
does not support."""

import mlx.core as mx
import pytest
from mlx_lm.models import starcoder2

import mlx_eagle.costs
from mlx_eagle import stream_generate
from drafting import decoder as make_decoder
from mlx_eagle.costs import Costs
from mlx_eagle.drafters import Budget
from mlx_eagle.heads import new_head
from mlx_eagle.drafters.lookup import ContextIndex, LookupDraft, LookupDrafter
from mlx_eagle.trees import DraftTree
from mlx_eagle.verify import Sampling
from fixed_costs import CPU_COSTS
from oracle import OracleHead

from commands import run_generate
from plain import plain_tokens

def test_the_longest_most_recent_match_is_continued():
    index = ContextIndex(min_ngram=1, max_ngram=3)
    index.commit([5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7])
    assert index.match() == (2, 7)  # "6 7" last seen before 9 (not before 8), and no earlier "2 6 7"
    assert index.continuation(7, 3) == [9, 2, 6]
    index.commit([9])
    assert index.match() == (3, 8)  # "6 7 9" now has an earlier occurrence
    index.reset([4, 4, 4])
    assert index.tokens == [4, 4, 4] and index.match() == (2, 2)
    # the copy runs past the end: it repeats with the match's period
    assert index.continuation(2, 4) == [4, 4, 4, 4]
    index.reset([1, 2, 3])
    assert index.match() == (0, -1)


def test_committing_costs_a_few_updates_whatever_the_context():
    index = ContextIndex(min_ngram=2, max_ngram=4)
    index.commit(list(range(1000)))
    size = len(index.after)
    index.commit([3])
    assert len(index.after) - size <= 3 and len(index.tokens) == 1001
    index.reset(list(range(1000)) + [3, 8])  # a continuation: extended, not rebuilt
    assert index.tokens[-2:] == [3, 8]


def test_draft_length_follows_device_costs_and_acceptance():
    steep = Costs({1: 50.0, 2: 60.0, 4: 80.0, 8: 100.0, 16: 130.0}).at()  # like this CPU
    flat = Costs({1: 10.0, 16: 10.5}).at()  # like a GPU
    assert steep(1) == 1.0 and steep(3) == pytest.approx(1.4) and steep(32) == pytest.approx(3.8)
    rarely, often, rarely_flat = LookupDrafter(steep), LookupDrafter(steep), LookupDrafter(flat)
    for _ in range(50):
        rarely.record(LookupDraft([1, 2], kind=1), accepted=0)
        rarely_flat.record(LookupDraft([1, 2], kind=1), accepted=0)
        often.record(LookupDraft(list(range(16)), kind=1), accepted=16)
    assert rarely.best_length(1, 16, verified=1, expected=1.0) == 0  # plain decoding wins
    assert often.best_length(1, 16, verified=1, expected=1.0) == 16
    # a flat curve drafts even what is rarely accepted
    assert rarely_flat.best_length(1, 16, verified=1, expected=1.0) > 0
    # histories are kept per kind of draft: a 4-token match starts from the prior
    assert 0 < often.best_length(4, 16, verified=1, expected=1.0) < 16


def test_draft_length_follows_the_context_a_round_attends_to():
    """Deep in a long context a block's attention costs more than one token's: the same
    acceptance buys a shorter draft there (costs timed at 256 and LONG_CONTEXT entries)."""
    costs = Costs({1: 50.0, 2: 52.0, 4: 56.0, 8: 64.0, 16: 80.0},
                  long_verify_ms={1: 60.0, 4: 90.0, 16: 200.0})
    near, far = costs.at(256), costs.at(16384)
    assert far.verify(1) > 50.0 and far(16) > 5 * near.verify(16) / 50.0  # plain steps at that context
    drafter = LookupDrafter(near)
    for index in range(50):
        drafter.record(LookupDraft(list(range(16)), kind=1), accepted=[1, 3, 6, 9, 14][index % 5])
    drafter.price(Budget(room=16, nodes=16, pricing=far))
    deep = drafter.best_length(1, 16, verified=1, expected=1.0)
    drafter.price(Budget(room=16, nodes=16, pricing=near))
    assert drafter.best_length(1, 16, verified=1, expected=1.0) > deep > 0


def test_grafting_shares_prefixes():
    tree = DraftTree()
    a = tree.add(10, -1)
    b = tree.add(11, a)
    tree.add(12, -1)
    nodes = tree.graft([10, 11, 13, 14])
    assert nodes[:2] == [a, b] and len(tree) == 5
    assert tree.parents[nodes[2]] == b and tree.parents[nodes[3]] == nodes[2]
    assert tree.depths[nodes[3]] == 4


COPYING = [
    "Repeat this sentence exactly, twice: The quick brown fox jumps over the lazy dog near the river bank.",
    "Fix the typo in this code and return all of it:\n\ndef greet(name):\n    message = 'Hello, ' + nme\n"
    "    print(message)\n    return message\n",
    "What is the capital of France?",
]


def _decode(model, ids, head, tree, eos, max_tokens=64):
    """Greedy decoding through the decoder with a lookup drafter; (tokens, lookup tokens accepted)."""
    drafter = LookupDrafter(Costs({1: 1.0, 16: 1.2}).at())  # cheap verification: lookup drafts freely
    decoder = make_decoder(model, head, tree, Sampling(), lookup=drafter)
    tokens = [decoder.prefill(ids)]
    while len(tokens) < max_tokens and tokens[-1] not in eos:
        tokens += decoder.round(max_tokens - len(tokens)).tokens
    return tokens, int(drafter.accepted.sum())


@pytest.mark.parametrize("text", COPYING)
def test_lookup_alone_keeps_greedy_output(smollm, text, monkeypatch):
    model, tokenizer = smollm
    # this CPU's timed curve, so that what is drafted does not depend on the machine's load
    monkeypatch.setattr(mlx_eagle.costs, "verify_costs", lambda model, kv=None: CPU_COSTS)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    expected = plain_tokens(model, ids, 64, tokenizer.eos_token_ids)
    responses = list(stream_generate(model, tokenizer, ids, max_tokens=64, draft="lookup"))
    assert [r.token for r in responses] == expected
    if text is COPYING[0]:
        assert responses[-1].tokens_per_forward > 1.5, responses[-1].tokens_per_forward  # copies were drafted


@pytest.mark.parametrize("family,tree", [("eagle1", "chain:3"), ("eagle3", "static:default"),
                                         ("eagle3", "dynamic:topk=3,depth=3,tokens=8"), ("oracle", "static:default")])
def test_lookup_merged_with_a_head_keeps_greedy_output(smollm, family, tree):
    model, tokenizer = smollm
    ids = tokenizer.apply_chat_template([{"role": "user", "content": COPYING[1]}], add_generation_prompt=True)
    expected = plain_tokens(model, ids, 64, tokenizer.eos_token_ids)
    if family == "oracle":
        head = OracleHead(ids + expected, model.args.vocab_size)
    else:
        head = new_head(model, family, draft_vocab_size=8192 if family == "eagle3" else None, seed=1)
    tokens, from_lookup = _decode(model, ids, head, tree, tokenizer.eos_token_ids)
    assert tokens[:len(expected)] == expected
    assert from_lookup > 5  # the lookup branch was verified and accepted in the merged tree


def test_lookup_works_on_any_mlx_lm_architecture():
    """StarCoder2 is none of the architectures the tree path drives directly; lookup
    drafts (and a head's chains) go through its own forward pass. A random model's greedy
    text loops, so its own reply is drafted from and accepted."""
    mx.random.seed(3)
    args = starcoder2.ModelArgs(model_type="starcoder2", hidden_size=64, num_hidden_layers=2,
                                intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=97)
    model = starcoder2.Model(args)
    mx.eval(model.parameters())
    prompt = [5, 17, 33, 5, 17, 60, 2, 9]
    expected = plain_tokens(model, prompt, 48)
    drafter = LookupDrafter(Costs({1: 1.0, 16: 1.2}).at())
    decoder = make_decoder(model, None, "none", Sampling(), lookup=drafter)
    tokens = [decoder.prefill(prompt)]
    while len(tokens) < 48:
        tokens += decoder.round(48 - len(tokens)).tokens
    assert tokens == expected
    assert drafter.accepted.sum() > 10 and decoder.forwards < 40
    # A head drafts chains on it too, its states read on the model's own forward pass.
    decoder = make_decoder(model, OracleHead(prompt + expected, 97), "chain:2", Sampling())
    tokens = [decoder.prefill(prompt)]
    while len(tokens) < 48:
        tokens += decoder.round(48 - len(tokens)).tokens
    assert tokens[:48] == expected and decoder.forwards < 40


def test_a_sliding_window_model_stays_lossless_once_its_window_wraps():
    """OLMo 3's sliding-window layers keep mlx-lm's RotatingKVCache, which can be cut back
    only until it wraps (rewind.py): past its window (8 tokens here) a rejected draft rolls
    it back from a snapshot, and the accepted tokens are read again. Cutting it back as a
    KVCache changed the text here. A second turn continuing the first reuses the caches."""
    from mlx_lm.models import olmo3

    from mlx_eagle.prompt_cache import make_prompt_cache

    mx.random.seed(3)
    args = olmo3.ModelArgs(model_type="olmo3", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=97, rms_norm_eps=1e-6,
                           max_position_embeddings=512, sliding_window=8, rope_theta=10000.0)
    model = olmo3.Model(args)
    mx.eval(model.parameters())
    prompt = [5, 17, 33, 5, 17, 60, 2, 9] * 2
    cache, accepted = make_prompt_cache(model), 0
    for turn in range(2):
        expected = plain_tokens(model, prompt, 60)
        drafter = LookupDrafter(Costs({1: 1.0, 16: 1.2}).at())
        decoder = make_decoder(model, None, "none", Sampling(), lookup=drafter, cache=cache)
        tokens = [decoder.prefill(prompt)]
        while len(tokens) < 60:
            tokens += decoder.round(60 - len(tokens)).tokens
        decoder.truncate(len(prompt) + 60)
        assert tokens[:60] == expected
        assert decoder.reused == (0 if turn == 0 else len(prompt) - 3)  # all but the two new tokens and the last
        accepted += drafter.accepted.sum()
        prompt = prompt + tokens[:60] + [11, 12]
    assert accepted > 10


def test_the_command_drafts_from_the_context_and_says_so(smollm, tmp_path, monkeypatch):
    import json

    from mlx_eagle.costs import device_key, model_digest

    # a cache holding this CPU's timed curve for the model, as the command's first run writes it
    calibration = tmp_path / "calibration" / f"{device_key(smollm[0])}-{model_digest(smollm[0])}.json"
    calibration.parent.mkdir()
    calibration.write_text(json.dumps({"verify_ms": CPU_COSTS.verify_ms}))
    monkeypatch.setenv("MLX_EAGLE_CACHE", str(tmp_path))

    def run(*args):
        return run_generate("--prompt", COPYING[0], "--max-tokens", "40", "--verbose", *args)

    lookup, plain = run("--draft", "lookup"), run("--draft", "none")
    assert lookup.returncode == 0 and plain.returncode == 0, lookup.stderr + plain.stderr
    assert "drafts: context lookup" in lookup.stderr and "drafts: none (plain decoding)" in plain.stderr
    assert lookup.stdout == plain.stdout and "quick brown fox" in lookup.stdout
    tau = float(lookup.stderr.split("tau: ")[1].split()[0])
    assert tau > 1.5, lookup.stderr


def test_in_a_packed_pass_a_draft_is_priced_by_the_whole_batch():
    """Beside other conversations a block's nodes cost what they add to the shared pass,
    in a plain batched row's steps: on a curve nearly flat alone (a CPU's small blocks), a
    draft accepted one time in five pays alone and not beside seven others; alone, the
    price is the one-row curve's."""
    costs = Costs({1: 100.0, 8: 135.0, 16: 175.0, 32: 255.0})
    verify, alone, batched = costs.verify, costs.at(), costs.at(beside=(7, 8))  # seven others' roots
    assert batched(1) == pytest.approx(1.0)  # a root beside seven: one batched row's share
    assert batched(2) == pytest.approx(1 + (verify(9) - verify(8)) / (verify(8) / 8))
    assert batched(9) - batched(1) > 5 * (alone(9) - 1.0)  # eight nodes cost far more here than alone
    drafter = LookupDrafter(batched)
    for index in range(50):  # all of it one time in five, else nothing
        drafter.record(LookupDraft(list(range(8)), kind=1), accepted=8 if index % 5 == 0 else 0)
    assert drafter.best_length(1, 8, verified=1, expected=1.0) == 0  # plain batching
    drafter.price(Budget(room=8, nodes=8, pricing=alone))
    assert drafter.best_length(1, 8, verified=1, expected=1.0) == 8
