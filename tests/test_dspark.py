"""DSpark block drafters (drafters/dspark.py): checkpoints written in DeepSpec's layout load
(their copies of the target's embedding and LM head set aside), and the drafted block and
its confidences equal an independent numpy reference of the published forward pass, for
each Markov head; greedy decoding equals plain mlx-lm on tiny models and the real SmolLM2,
whatever the confidences say (true, always 1, always 0); the confidences cut the chain on
a steep curve and the calibration learns what was accepted; bad checkpoints get one line.
(Sampling: tests/test_sampling.py; a batch: tests/test_batch.py.)"""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from mlx_eagle.drafters.composite import Composite
from mlx_eagle.drafters.dspark import Calibration, DSparkDrafter, load
from mlx_eagle.drafters.lookup import LookupDrafter
from mlx_eagle.errors import UserError
from block_reference import reference_block_states
from checkpoints import refused_in_one_line, tiny_target, write_dspark
from commands import run_generate
from drafting import decode
from plain import plain_tokens


PROMPT = [5, 17, 33, 5, 17, 60, 2, 9, 41, 17, 5, 17, 33]
SMOLLM_SIZES = {"num_hidden_layers": 1, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                "intermediate_size": 256}


def reference_draft(t, config, states, root, embed, head):
    """The block's drafts and confidences as DeepSpec drafts them: backbone logits plus the
    Markov bias from the previous draft, argmax left to right."""
    hidden = reference_block_states(t, config, states, [root] + [config["mask_token_id"]] * (config["block_size"] - 1),
                                    embed)
    base = hidden @ head.T
    w1, w2 = t["markov_head.markov_w1.weight"], t["markov_head.markov_w2.weight"]
    kind, rank = config["markov_head_type"], w1.shape[1]
    previous, carried, tokens, confidences = root, np.zeros(rank), [], []
    for i, state in enumerate(hidden):
        embedding = w1[previous]
        latent = embedding
        if kind == "gated":
            gate = np.concatenate([state, embedding]) @ t["markov_head.gate_proj.weight"].T + \
                t["markov_head.gate_proj.bias"]
            latent = embedding / (1 + np.exp(-gate))
        if kind == "rnn":
            z = np.concatenate([carried, embedding, state]) @ t["markov_head.joint_proj.weight"].T + \
                t["markov_head.joint_proj.bias"]
            gate, candidate, output = 1 / (1 + np.exp(-z[:rank])), np.tanh(z[rank:2 * rank]), z[2 * rank:]
            carried = gate * carried + (1 - gate) * candidate
            latent = np.tanh(output)
        logits = base[i] + latent @ w2.T
        if config.get("enable_confidence_head"):
            features = np.concatenate([state, embedding]) if config.get("confidence_head_with_markov") else state
            logit = features @ t["confidence_head.proj.weight"][0] + t["confidence_head.proj.bias"][0]
            confidences.append(1 / (1 + np.exp(-logit)))
        previous = int(np.argmax(logits))
        tokens.append(previous)
    return tokens, confidences


@pytest.mark.parametrize("markov, confidence, with_markov, interleave", [
    ("vanilla", True, True, False), ("vanilla", True, False, False), ("gated", True, True, False),
    ("rnn", False, False, False), ("vanilla", True, True, True)])
def test_the_drafted_block_equals_the_numpy_reference(tmp_path, markov, confidence, with_markov, interleave):
    """Context read in two rounds (its keys cached), then a block: the tokens and
    confidences of one reference pass; each Markov head, the confidence head with and
    without the previous token's embedding, and rotary pairs interleaved (LFM2.5's)."""
    target = tiny_target()
    config, tensors = write_dspark(tmp_path / "dspark", target, [-1, 3], markov=markov, confidence=confidence,
                                   with_markov=with_markov, rope_interleave=interleave)
    drafter = load(tmp_path / "dspark", target)
    assert drafter.config.taps == (0, 4)  # -1: the embedding output, the state entering layer 0
    rng = np.random.default_rng(1)
    states = rng.standard_normal((9, 2 * 64)).astype(np.float32)
    cache = [KVCache() for _ in drafter.layers]
    drafter.read_context(mx.array(states[:6]), cache, 0)
    drafter.read_context(mx.array(states[6:]), cache, 6)
    tokens, confidences = drafter.draft_blocks(target, [(41, cache, 9)])
    tokens, confidences = tokens[0], None if confidences is None else confidences[0]
    want_tokens, want_confidences = reference_draft(tensors, config, states, 41,
                                                    np.array(target.model.embed_tokens.weight),
                                                    np.array(target.lm_head.weight))
    assert tokens.tolist() == want_tokens and len(want_tokens) == config["block_size"]
    if confidence:
        assert np.allclose(np.array(confidences), want_confidences, atol=1e-4)
    else:
        assert confidences is None


def wrong_on_purpose(directory, logit):
    """The checkpoint at ``directory`` with a confidence head that always says sigmoid(logit)."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(directory / "model.safetensors"))
    tensors["confidence_head.proj.weight"] = np.zeros_like(tensors["confidence_head.proj.weight"])
    tensors["confidence_head.proj.bias"] = np.full_like(tensors["confidence_head.proj.bias"], logit)
    save_file(tensors, str(directory / "model.safetensors"))


@pytest.mark.parametrize("confidences", ["the head's", "always 1", "always 0", "no head"])
@pytest.mark.parametrize("curve", ["flat", "steep"])
def test_greedy_decoding_equals_mlx_lm_whatever_the_confidences_say(tmp_path, confidences, curve):
    target = tiny_target()
    write_dspark(tmp_path / "dspark", target, [1, 3], confidence=confidences != "no head")
    if confidences.startswith("always"):
        wrong_on_purpose(tmp_path / "dspark", 30.0 if confidences == "always 1" else -30.0)
    cost = (lambda k: 1.0) if curve == "flat" else (lambda k: 1.0 + 0.3 * (k - 1))
    drafter = DSparkDrafter(load(tmp_path / "dspark", target), target, cost)
    proposed = []
    propose = drafter.propose
    drafter.propose = lambda budget: proposed.append(propose(budget)) or proposed[-1]
    tokens, _ = decode(target, Composite([drafter, LookupDrafter(lambda k: 1.0)]), PROMPT, 40)
    assert tokens == plain_tokens(target, PROMPT, 40)
    made = [p for p in proposed if p is not None]
    if (confidences, curve) == ("always 0", "steep"):
        assert not made  # no draft could pay
        return
    assert made and all(p.tree.is_chain() and len(p) <= 6 for p in made)
    if confidences != "no head":
        assert all(p.confidence is not None and len(p.confidence) == len(p) for p in made)
        assert drafter.calibration.count.sum() > 0, "what was verified was recorded"


def test_confidences_cut_the_chain_where_the_next_draft_would_not_pay(tmp_path):
    """Alone (no lookup), on a steep curve: a head sure of everything gets its whole block
    verified; one sure of nothing gets no draft at all, and costs what plain decoding does;
    and once its sure drafts are rejected, measured acceptance stops the drafting."""
    target = tiny_target()
    verified = {}
    for logit in (30.0, -30.0):
        directory = tmp_path / f"dspark{logit}"
        write_dspark(directory, target, [1, 3])
        wrong_on_purpose(directory, logit)
        drafter = DSparkDrafter(load(directory, target), target, lambda k: 1.0 + 0.3 * (k - 1))
        verified[logit] = []
        drafter.learn = lambda outcome, log=verified[logit], learn=drafter.learn: \
            log.append(len(outcome.proposal)) or learn(outcome)
        assert decode(target, drafter, PROMPT, 24)[0] == plain_tokens(target, PROMPT, 24)
    assert verified[30.0][0] == 6 and len(verified[30.0]) < 8  # then held back: its drafts were rejected
    assert verified[-30.0] == []


def test_the_calibration_maps_a_band_to_what_was_accepted():
    calibration = Calibration()
    for _ in range(40):  # a head that says 0.95 where half are accepted
        calibration.record([0.95, 0.95], 2, 1)
    assert calibration.table() == [{"band": [0.9, 1.0], "drafts": 80, "predicted": pytest.approx(0.95),
                                    "observed": 0.5}]
    assert calibration.adjusted(np.array([0.95]))[0] == pytest.approx((40 + 8 * 0.95) / 88)
    assert calibration.adjusted(np.array([0.15]))[0] == pytest.approx(0.15)  # a band never seen: the head's


def test_smollm2_decodes_losslessly_with_a_random_drafter(smollm, tmp_path):
    """The real model with a random DSpark drafter reading three of its layers and its
    embedding output, alone and merged with lookup, on a flat and a steep curve."""
    model, tokenizer = smollm
    write_dspark(tmp_path / "dspark", model, [-1, 14, 26], block=7, mask=0, rank=32, sizes=SMOLLM_SIZES)
    drafter = load(tmp_path / "dspark", model)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Repeat: the cat sat on the mat. The cat sat"}],
                                        add_generation_prompt=True)
    expected = plain_tokens(model, ids, 32)
    for cost in (lambda k: 1.0, lambda k: 1.0 + 0.05 * (k - 1)):
        for merged in (DSparkDrafter(drafter, model, cost),
                       Composite([DSparkDrafter(drafter, model, cost), LookupDrafter(lambda k: 1.0)])):
            tokens, _ = decode(model, merged, ids, 32)
            assert tokens == expected[:len(tokens)]


def test_the_command_drafts_with_a_dspark_directory_and_says_so(smollm, tmp_path):
    model, _ = smollm
    write_dspark(tmp_path / "dspark", model, [1, 14, 26], block=7, mask=0, rank=32, sizes=SMOLLM_SIZES)

    def run(*args):
        return run_generate("--prompt", "Count: 1, 2, 3, 4,", "--max-tokens", "16", "--verbose", *args)

    drafted, plain = run("--draft", str(tmp_path / "dspark")), run("--draft", "none")
    assert drafted.returncode == 0, drafted.stderr[-2000:]
    assert "drafts: dspark dspark, block 7 + context lookup" in drafted.stderr, drafted.stderr[-1500:]
    assert drafted.stdout == plain.stdout
    quantized = run("--draft", str(tmp_path / "dspark"), "--kv-bits", "8")
    assert quantized.returncode == 0, quantized.stderr[-2000:]
    assert quantized.stdout == run("--draft", "none", "--kv-bits", "8").stdout


BAD = [
    ({"markov_rank": None}, "no markov_rank; not a DSpark checkpoint"),
    ({"markov_rank": 0}, "markov_rank must be an integer from 1"),
    ({"markov_head_type": "carh"}, "markov_head_type 'carh' is not one of vanilla, gated, rnn"),
    ({"target_layer_ids": [1, 9]}, r"target_layer_ids \[9\] not below"),
    ({"target_layer_ids": [-2, 3]}, "target_layer_ids must be a list of layer numbers"),
    ({"mask_token_id": 500}, "mask token 500 outside"),
    ({"vocab_size": 50}, "vocabulary 50 vs the target's 97"),
    ({"confidence_head_with_markov": False}, r"weights do not match its config.json: 1 of another shape "
                                             r"\(e.g. confidence_head.proj.weight\)"),
    ({"enable_confidence_head": False}, r"2 unexpected \(e.g. confidence_head.proj.bias\)"),
]


@pytest.mark.parametrize("change, message", BAD, ids=[m for _, m in BAD])
def test_a_bad_checkpoint_gets_one_line(tmp_path, change, message):
    target = tiny_target()
    directory = tmp_path / "dspark"
    config, tensors = write_dspark(directory, target, [1, 3])
    config.update(change)
    refused_in_one_line(load, directory, target, {key: value for key, value in config.items() if value is not None},
                        message)


def test_the_converter_checks_casts_and_quantizes_a_dspark_checkpoint(smollm, tmp_path):
    from mlx_eagle.convert.head import convert_head

    model, _ = smollm
    write_dspark(tmp_path / "published", model, [1, 14, 26], block=7, mask=0, rank=32, sizes=SMOLLM_SIZES)
    quantized = convert_head(str(tmp_path / "published"), tmp_path / "q8", q_bits=8)
    written = mx.load(str(quantized / "model.safetensors"))
    assert json.loads((quantized / "config.json").read_text())["quantization"] == {"group_size": 64, "bits": 8}
    assert "layers.0.mlp.up_proj.scales" in written and "markov_head.markov_w1.weight" in written
    assert not any(name.startswith(("embed_tokens", "lm_head")) for name in written)  # the target's are used
    states = mx.array(np.random.default_rng(0).standard_normal((6, 3 * 576)).astype(np.float32))
    confidences = []
    for directory in (tmp_path / "published", quantized):
        drafter = load(directory, model)
        cache = [KVCache() for _ in drafter.layers]
        drafter.read_context(states, cache, 0)
        confidences.append(np.array(drafter.draft_blocks(model, [(42, cache, 6)])[1][0]))
    assert np.abs(confidences[0] - confidences[1]).max() < 0.05
    with pytest.raises(UserError, match="vocabulary 97 vs the target's 49152"):
        write_dspark(tmp_path / "other", tiny_target(), [1, 3])
        convert_head(str(tmp_path / "other"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_trainer_reports_a_drafters_calibration_on_held_out_prompts(smollm, tmp_path):
    """``mlx_eagle.train --family dspark``'s evaluation on the real SmolLM2: whole blocks
    decoded, tau, acceptance by position, and predicted against observed acceptance by band."""
    from mlx_eagle.train.families import FAMILIES
    from mlx_eagle.train.recipe import TrainConfig

    model, tokenizer = smollm
    write_dspark(tmp_path / "dspark", model, [1, 14, 26], block=7, mask=0, rank=32, sizes=SMOLLM_SIZES)
    config = TrainConfig(family="dspark", block_size=7)
    result, line = FAMILIES["dspark"].code().evaluate(model, tokenizer, tmp_path / "dspark", ["Say hi."], config,
                                                      False)
    assert len(result["acceptance_by_position"]) == 7 and result["rounds"] > 0
    assert sum(band["drafts"] for band in result["calibration"]) >= result["rounds"]  # each round verified one
    assert "confidence calibration error" in line and 0 <= result["calibration_error"] <= 1
