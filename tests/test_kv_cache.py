"""Quantized KV caches with speculation: greedy text is plain mlx-lm decoding's with the same
cache settings (the cache turning quantized while the prompt is read, and between two
rounds), a branch is cut out of a packed cache, samples follow the distribution plain
decoding samples from, a cache that cannot be quantized is one line, and rounds over a
quantized cache are priced by a curve timed over one."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

import mlx_eagle.costs
import mlx_eagle.generation
from drafting import decoder as make_decoder
from mlx_eagle import plan_drafts, stream_generate
from mlx_eagle import make_prompt_cache as conversation_cache
from mlx_eagle.costs import calibration_file, verify_costs
from mlx_eagle.errors import UserError
from mlx_eagle.replies import chat_tokens
from mlx_eagle.target import KVQuantization, keep_cache_entries, kv_quantization
from mlx_eagle.verify import Sampling
from oracle import FixedDraft
from sampling_checks import TREE, chi_square_ok
from plain import plain_tokens

VOCAB = 6
PROMPT = [1, 4, 2, 3, 0]


def plain_quantized(model, tokenizer, ids, max_tokens, bits, start):
    """mlx-lm's own greedy loop with quantized caches, reading the prompt as it does (2,048
    tokens at a time)."""
    return plain_tokens(model, ids, max_tokens, tokenizer.eos_token_ids, dict(kv_bits=bits, quantized_kv_start=start))


@pytest.mark.slow
def test_greedy_text_is_mlx_lms_with_the_same_quantized_cache(smollm):
    """SmolLM2 with its head's trees and context drafts, 4-bit: the cache turns quantized
    while the prompt is read (start 256: where mlx-lm's 2,048-token chunk ends, the prompt's
    last token; ours reads 512 at a time and must not turn after its first chunk, which
    changed the text from the first token), and between two rounds (8 tokens into the reply).
    The first 30 tokens are compared where the prompt turns it, the first 20 where the reply
    does: a round that ran past the point where the cache turns diverges soon after (by
    about a logit; checked), while a verified block's keys, rounded differently from one
    row's, can later land on another quantization level than plain decoding's and change a
    close call (on this prompt with MLX 0.32.4, 15 tokens after the cache turned 8 tokens
    into the reply, whichever drafts ran before: see docs/usage.md)."""
    model, tokenizer = smollm
    document = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7} marbles."
                        for i in range(42))
    ids = chat_tokens(tokenizer, [{"role": "user", "content": document + "\n\nRepeat the last three items."}])
    assert 512 < len(ids) < 700
    for start, compared in ((256, 30), (len(ids) + 8, 20)):
        got = [r.token for r in stream_generate(model, tokenizer, ids, max_tokens=compared, kv_bits=4,
                                                quantized_kv_start=start)]
        assert got == plain_quantized(model, tokenizer, ids, compared, 4, start), start


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["none", "auto"])
def test_a_prompt_is_read_into_the_quantized_cache_plain_mlx_lm_fills(smollm, draft):
    """Read as mlx-lm reads it (2,048 tokens a chunk, quantized after the chunk that reaches
    ``start``), a 700-token prompt leaves the packed keys and values mlx-lm's own reading
    leaves, bit for bit, with and without the head (which reads the target's states): keys
    computed in 512-token chunks round differently, and 4 bits keep other levels for some."""
    model, tokenizer = smollm
    ids = chat_tokens(tokenizer, [{"role": "user", "content": " ".join(f"Line {i}: a {i % 7}-sided die." for i in
                                                                        range(70)) + " Sum them."}])
    assert 600 < len(ids) < 2048
    slot = conversation_cache(model)
    list(stream_generate(model, tokenizer, ids, max_tokens=1, draft=draft, prompt_cache=slot, kv_bits=4,
                         quantized_kv_start=0))
    plain = make_prompt_cache(model)
    list(generate_step(mx.array(ids), model, prompt_cache=plain, max_tokens=0, kv_bits=4, quantized_kv_start=0))
    for ours, theirs in zip(slot.target, plain):
        assert isinstance(ours, QuantizedKVCache) and ours.offset == theirs.offset == len(ids)
        for mine, reference in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
            for part, other in zip(mine, reference):  # packed values, scales, biases
                assert mx.array_equal(part[..., :len(ids), :], other[..., :len(ids), :]).item()


def test_a_branch_is_cut_out_of_a_packed_cache():
    cache = [KVCache()]
    keys = mx.random.normal((1, 2, 10, 32))
    cache[0].update_and_fetch(keys, keys + 1)
    KVQuantization(4, 32, start=0).quantize_when_due(cache)
    assert isinstance(cache[0], QuantizedKVCache)
    before = [np.array(part) for part in cache[0].keys]
    keep_cache_entries(cache, 4, [0, 2, 5])  # a block of 6 from entry 4: keep its 1st, 3rd and 6th
    assert cache[0].offset == 7
    for part, old in zip(cache[0].keys, before):
        assert np.array_equal(np.array(part)[..., :7, :], old[..., [0, 1, 2, 3, 4, 6, 9], :])


@pytest.fixture(scope="module")
def quantizable_model():
    """A tiny llama over six tokens whose heads (32 wide) can be quantized in groups of 32."""
    mx.random.seed(11)
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=64,
                           num_attention_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB, num_key_value_heads=1,
                           max_position_embeddings=64, tie_word_embeddings=False, rope_theta=10000.0)
    model = llama.Model(args)
    model.lm_head.weight = model.lm_head.weight * 12
    mx.eval(model.parameters())
    return model


def plain_distribution(model, sampling: Sampling, kv: KVQuantization, context):
    """The distribution plain decoding samples the next token from after ``context``, its cache
    quantized as mlx-lm quantizes it (after the prompt's first block, then after each step)."""
    cache = make_prompt_cache(model)
    model(mx.array([PROMPT[:-1]]), cache=cache)
    kv.quantize_when_due(cache)
    logits = None
    for token in PROMPT[-1:] + list(context):
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
        kv.quantize_when_due(cache)
    return np.array(sampling.probabilities(logits)).astype(np.float64)


def test_sampling_follows_plain_decoding_with_a_quantized_cache(quantizable_model):
    sampling, kv = Sampling(temp=1.0), KVQuantization(4, 32, start=0)
    joint = np.zeros((VOCAB,) * 3)
    p1 = plain_distribution(quantizable_model, sampling, kv, [])
    for t1 in range(VOCAB):
        p2 = plain_distribution(quantizable_model, sampling, kv, [t1])
        for t2 in range(VOCAB):
            joint[t1, t2] = p1[t1] * p2[t2] * plain_distribution(quantizable_model, sampling, kv, [t1, t2])
    counts, accepted, samples = np.zeros((VOCAB,) * 3), 0, 1500
    likely = list(np.argsort(-joint.sum(axis=(0, 2))))
    for seed in range(samples):
        decoder = make_decoder(quantizable_model, FixedDraft(likely, VOCAB), TREE, sampling, seed=seed, kv=kv)
        tokens = [decoder.prefill(PROMPT)]
        while len(tokens) < 3:
            result = decoder.round(3 - len(tokens))
            tokens += result.tokens
            accepted += len(result.tokens) - 1
        assert isinstance(decoder.target_cache[0], QuantizedKVCache)
        counts[tuple(tokens[:3])] += 1
    assert chi_square_ok(counts, joint)
    assert accepted > samples / 3


def test_settings_and_caches_that_cannot_be_quantized_are_one_line():
    for settings, says in [({"kv_bits": 7}, "kv_bits must be one of"), ({"kv_bits": 4, "kv_group_size": 48},
                                                                         "kv_group_size"),
                           ({"kv_bits": 8, "quantized_kv_start": -1}, "quantized_kv_start")]:
        with pytest.raises(UserError, match=says):
            kv_quantization(**settings)
    assert kv_quantization(None) is None
    with pytest.raises(UserError, match="RotatingKVCache"):
        KVQuantization(4).check([KVCache(), RotatingKVCache(max_size=16)])


def test_quantized_caches_price_verification_by_their_own_curve(quantizable_model, tmp_path, monkeypatch):
    """Past ``quantized_kv_start`` a block attends over packed keys, which MLX's quantized
    products price differently (on a CPU several times the float ones): those rounds are
    sized by a curve timed over a quantized cache, kept in a file of its own per setting,
    and the plan's drafters and its decoder share that one Costs."""
    monkeypatch.setenv("MLX_EAGLE_CACHE", str(tmp_path))
    monkeypatch.setattr(mlx_eagle.costs, "_CURVES", {})
    kv = KVQuantization(8, 32, start=1024)
    timed = verify_costs(quantizable_model, kv)  # times both curves on this tiny model, once, and keeps them
    assert calibration_file(quantizable_model).exists() and calibration_file(quantizable_model, kv).exists()
    assert calibration_file(quantizable_model, kv) != calibration_file(quantizable_model, KVQuantization(4, 32))
    assert timed.quantized.logit_drift is not None

    for setting, curve in [(None, {"1": 10.0, "2": 12.0, "16": 20.0}), (kv, {"1": 20.0, "2": 30.0, "16": 120.0})]:
        calibration_file(quantizable_model, setting).write_text(
            json.dumps({"verify_ms": curve, "logit_drift": 1e-4}))
    monkeypatch.setattr(mlx_eagle.costs, "_CURVES", {})
    costs = verify_costs(quantizable_model, kv)
    assert costs.at(768).steps(16) == 2.0  # not yet quantized: the float curve
    assert costs.at(1024).steps(16) == 6.0
    assert verify_costs(quantizable_model).quantized is None and verify_costs(quantizable_model).at(1024)(16) == 2.0

    plan = plan_drafts(quantizable_model, "lookup", history=False, kv_bits=8, kv_group_size=32,
                       quantized_kv_start=1024)
    assert plan.settings.costs is costs  # what the decoder prices each round with is what the drafters start from
    with pytest.raises(UserError, match="other KV cache settings"):
        plan_drafts(quantizable_model, plan, kv_bits=4, kv_group_size=32, quantized_kv_start=1024)


def test_a_long_prompt_has_the_forwards_timed_that_deep_once_it_is_read(smollm, tmp_path, monkeypatch, capsys):
    """Rounds deep in a long prompt are priced on the line through curves timed near the
    start and after LONG_CONTEXT entries: a first prompt that long has the second timed
    (once per device and setting, kept), for the float cache and the quantized one."""
    model, tokenizer = smollm
    monkeypatch.setenv("MLX_EAGLE_CACHE", str(tmp_path))
    monkeypatch.setattr(mlx_eagle.costs, "_CURVES", {})
    for module in (mlx_eagle.costs, mlx_eagle.generation):  # (the real one's reading takes a while here)
        monkeypatch.setattr(module, "LONG_CONTEXT", 320)
    kv = KVQuantization(8, 64, start=0)
    for setting in (None, kv):  # the near curves, as if timed already: only the long ones are timed here
        calibration_file(model, setting).parent.mkdir(exist_ok=True)
        calibration_file(model, setting).write_text(
            json.dumps({"verify_ms": {"1": 60.0, "2": 66.0, "4": 75.0, "16": 110.0}, "logit_drift": 1e-4}))
    long_prompt = tokenizer.encode("The tide comes in and goes out again. " * 40)
    assert 320 <= len(long_prompt) < 1024
    for ids, timed in [(long_prompt[:100], False), (long_prompt, True)]:
        list(stream_generate(model, tokenizer, ids, max_tokens=2, draft="lookup", history=False, kv_bits=8,
                             quantized_kv_start=0))
        for setting in (None, kv):
            kept = json.loads(calibration_file(model, setting).read_text()).get("long_verify_ms")
            assert (kept is not None and set(kept) == {"1", "4", "16"}) == timed
    assert capsys.readouterr().err.count("after 320 tokens, once") == 2


def test_a_group_size_that_does_not_divide_the_head_size_is_one_line_before_timing(monkeypatch):
    """head_dim 32 with mlx-lm's default group of 64: mx.quantize would fail inside the
    device's timing; the check names the fix first, and a hybrid's caches too."""
    model = llama.Model(llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2,
                                        intermediate_size=64, num_attention_heads=2, rms_norm_eps=1e-5,
                                        vocab_size=32, num_key_value_heads=2))
    monkeypatch.setattr(mlx_eagle.costs, "verify_costs", lambda *a, **k: pytest.fail("timed before the check"))
    with pytest.raises(UserError, match="does not divide this model's attention head size \\(32\\); give "
                                        "--kv-group-size 32"):
        plan_drafts(model, "lookup", history=False, kv_bits=4)
    KVQuantization(4, 32).check_model(model)
