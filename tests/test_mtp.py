"""A model's own MTP module as its drafter (drafters/mtp.py), for Qwen3-Next, Qwen3.5, MiMo,
DeepSeek-V3, GLM-4.5 and GLM-4.7-Flash: its draft logits equal an independent numpy
reference of the published step (and the reference with the concatenation swapped does
not); raw Hugging Face tensors come out in mlx-lm's layout; greedy decoding with it, merged
with lookup, equals mlx-lm (chains, and trees where target.py drives the target: MiMo,
DeepSeek-V3, GLM-4.5, GLM-4.7-Flash); a model directory that holds one drafts with it by default, and the converter
keeps it; partial MTP tensors get one line."""


import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache

import hybrids
from hybrids import VOCAB
from hybrids import decode, reference, text_model, write_directory
from mlx_eagle.drafters.composite import Composite
from mlx_eagle.drafters.eagle import EagleDrafter
from mlx_eagle.drafters.lookup import LookupDrafter
from mlx_eagle.mtp_model import MTPModule, module_for, sanitize_mtp
from mlx_eagle.errors import UserError
from mlx_eagle.target import inner_model
from mlx_eagle.trees import parse_tree
from commands import run_generate
from checkpoints import EXPERT_CONFIGS, mtp_tensors, new_module

FAMILIES = ["qwen3_next", "qwen3_5", "mimo", *EXPERT_CONFIGS]


def mimo_config(vocab_size: int = VOCAB) -> dict:
    from synthetic import target_config

    return target_config("mimo", vocab_size)


def build(family: str, vocab_size: int = VOCAB):
    """A tiny target of ``family``: a hybrid's text model, or MiMo (Qwen2's layers)."""
    if family == "mimo" or family in EXPERT_CONFIGS:
        from synthetic import build_model

        config = mimo_config(vocab_size) if family == "mimo" else dict(EXPERT_CONFIGS[family], vocab_size=vocab_size)
        return build_model(config)
    return text_model(hybrids.build(family, vocab_size=vocab_size))


def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


@pytest.mark.parametrize("family", FAMILIES)
def test_the_draft_logits_equal_the_published_step(family):
    """fc(concat[norm(embedding of token t + 1), norm(hidden t)]) (MiMo: [hidden, embedding])
    -> the layer -> norm -> the target's LM head, against numpy (the decoder layer itself
    is mlx-lm's; DeepSeek's and GLM's embedding at position 0 is zeroed); the test fails if
    the order of the concatenation is swapped."""
    from mlx_lm.models.base import create_causal_mask

    model = build(family)
    module = new_module(model)
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((1, 5, model.args.hidden_size)).astype(np.float32)
    tokens = np.array([[5, 17, 33, 60, 2]])
    got = np.array(module.logits(model, module.step(model, mx.array(hidden), mx.array(tokens), [KVCache()], 0,
                                                    "causal")))
    weights = {k: np.array(v) for k, v in tree_flatten(module.parameters())}
    eps = model.args.rms_norm_eps
    embedding = np.array(inner_model(model).embed_tokens.weight)[tokens]
    if family in EXPERT_CONFIGS:
        embedding[:, 0] = 0.0
    head = np.array(model.lm_head.weight) if "lm_head" in model else np.array(inner_model(model).embed_tokens.weight)

    def reference_logits(first, second):
        x = np.concatenate([first, second], axis=-1) @ weights["fc.weight"].T
        layer_out = np.array(module.layers[0](mx.array(x), mask=create_causal_mask(5, 0), cache=KVCache()))
        return rms(layer_out, weights["norm.weight"], eps) @ head.T

    normed_embedding = rms(embedding, weights["pre_fc_norm_embedding.weight"], eps)
    normed_hidden = rms(hidden, weights["pre_fc_norm_hidden.weight"], eps)
    published = (normed_hidden, normed_embedding) if family == "mimo" else (normed_embedding, normed_hidden)
    expected = reference_logits(*published)
    assert np.abs(got - expected).max() < 1e-4 * max(1.0, np.abs(expected).max())
    swapped = reference_logits(*published[::-1])
    assert np.abs(got - swapped).max() > 1e-2 * np.abs(expected).max()


def test_raw_hugging_face_tensors_come_out_in_mlx_lms_layout():
    """Published checkpoints store norms as offsets from 1 and experts one by one."""
    model = hybrids.build("qwen3_next")
    ours = mtp_tensors(new_module(model))
    raw = {}
    for name, value in ours.items():
        if ".switch_mlp." in name:
            for expert in range(value.shape[0]):
                raw[name.replace("switch_mlp.", f"experts.{expert}.")] = value[expert]
        elif value.ndim == 1:  # every vector of the module is a norm's weight
            raw[name] = value - 1.0
        else:
            raw[name] = value
    assert any(".experts.0." in name for name in raw)
    back = sanitize_mtp(raw, model, raw=True)
    assert set(back) == set(ours) and all(mx.allclose(back[k], ours[k], atol=1e-6) for k in ours)


def test_mimo_tensors_come_out_in_one_layout():
    """MiMo's names (model.mtp_layers.0: input_proj, token_layernorm, hidden_layernorm,
    final_layernorm, the decoder layer's own beside them) come out under Qwen's; a second
    module (model.mtp_layers.1) is not read: the first drafts at every depth."""
    model = build("mimo")
    module = new_module(model)
    named = mtp_tensors(module)
    assert "model.mtp_layers.0.input_proj.weight" in named and "model.mtp_layers.0.self_attn.q_proj.weight" in named
    extra = {name.replace("mtp_layers.0.", "mtp_layers.1."): value for name, value in named.items()}
    back = sanitize_mtp(named | extra, model, raw=False)
    ours = {f"mtp.{name}": value for name, value in tree_flatten(module.parameters())}
    assert set(back) == set(ours) and all(mx.array_equal(back[k], ours[k]) for k in ours)


@pytest.mark.parametrize("family, tree", [(family, "chain:3") for family in FAMILIES]
                         + [(family, "static:default") for family in ("mimo", *EXPERT_CONFIGS)])
def test_greedy_decoding_with_the_module_equals_mlx_lm(family, tree):
    """Chains on every family; trees (the top tokens at each depth) where target.py drives
    the target, MiMo, DeepSeek-V3 and the GLMs (the plan asks Qwen's hybrids for chains)."""
    model = build(family)
    drafter = EagleDrafter(module_for(model, mtp_tensors(new_module(model), model), "test"), model, parse_tree(tree))
    tokens, decoder = decode(model, Composite([drafter, LookupDrafter(lambda k: 1.0)]), count=30)
    assert tokens == reference(model, count=30)


@pytest.mark.parametrize("family, projection", [("qwen3_next", "mtp.fc.weight"),
                                                ("mimo", "model.mtp_layers.0.input_proj.weight")])
def test_partial_mtp_tensors_get_one_line(family, projection):
    model = build(family)
    tensors = mtp_tensors(new_module(model), model)
    tensors.pop(projection)
    with pytest.raises(UserError, match=r"not a whole module for this model: 1 missing \(e.g. mtp.fc.weight\)"):
        module_for(model, tensors, "ckpt")


@pytest.mark.parametrize("family", ["qwen3_next", "mimo", "deepseek_v3"])
def test_a_directory_with_an_mtp_module_drafts_with_it_and_conversion_keeps_it(tmp_path, family):
    """The module in the checkpoint (as published, beside the model's tensors): the
    converter keeps it in mtp.safetensors, and `generate` drafts with it with no --draft."""
    from mlx_eagle import load
    from mlx_eagle.convert.target import convert_target
    from mlx_eagle.plan import load_draft

    configs = {"mimo": mimo_config(), **EXPERT_CONFIGS}
    directory = write_directory(tmp_path, family, configs.get(family))
    model, _ = load(str(directory))
    weights = dict(mx.load(str(directory / "model.safetensors")))
    module = new_module(model)
    mx.save_safetensors(str(directory / "model.safetensors"), weights | mtp_tensors(module, model))
    converted = convert_target(directory, tmp_path / "converted", progress=False)
    assert (converted / "mtp.safetensors").exists()
    target, _ = load(str(converted))
    found = load_draft("auto", target)
    assert isinstance(found, MTPModule)
    kept = dict(tree_flatten(found.parameters()))
    assert all(mx.allclose(kept[k], v, atol=1e-6) for k, v in tree_flatten(module.parameters()))

    def run(*args):
        return run_generate("--model", str(converted), "--prompt",
                               "The quick brown fox. The quick brown fox. The quick", "--max-tokens", "24",
                               "--verbose", *args)

    drafted, plain = run("--tree", "chain:3"), run("--draft", "none")
    assert drafted.returncode == 0 and plain.returncode == 0, drafted.stderr[-2000:]
    assert "drafts: the model's MTP module, tree chain:3" in drafted.stderr, drafted.stderr[-1500:]
    assert drafted.stdout == plain.stdout


@pytest.mark.parametrize("family", ["qwen3_next", "deepseek_v3"])
def test_a_quantized_conversion_quantizes_the_module_too(tmp_path, family):
    """--q-bits quantizes the module's projections as the model's (its norms stay float);
    it loads back, and drafts losslessly for the quantized target."""
    from mlx_eagle import load
    from mlx_eagle.convert.target import convert_target
    from mlx_eagle.plan import load_draft

    directory = write_directory(tmp_path, family, EXPERT_CONFIGS.get(family))
    model, _ = load(str(directory))
    weights = dict(mx.load(str(directory / "model.safetensors")))
    mx.save_safetensors(str(directory / "model.safetensors"), weights | mtp_tensors(new_module(model), model))
    converted = convert_target(directory, tmp_path / "converted", q_bits=8, progress=False)
    kept = mx.load(str(converted / "mtp.safetensors"))
    assert "mtp.fc.scales" in kept and "mtp.norm.weight" in kept and "mtp.norm.scales" not in kept
    target, _ = load(str(converted))
    module = load_draft("auto", target)
    assert isinstance(module, MTPModule)
    drafter = Composite([EagleDrafter(module, target, parse_tree("chain:3")), LookupDrafter(lambda k: 1.0)])
    tokens, _ = decode(target, drafter, count=20)
    assert tokens == reference(target, count=20)


def test_auto_prefers_the_drafter_whose_recorded_acceptance_is_higher(tmp_path):
    """A model with both its own MTP module and a head shipped for it drafts with the one
    whose recorded acceptance promises more tokens a round; the module on a tie."""
    import json

    from mlx_eagle.heads import new_head
    from mlx_eagle.plan import best_shipped

    model = build("mimo")
    module = module_for(model, mtp_tensors(new_module(model), model), "test")
    head = new_head(model, "eagle3")
    head.directory = tmp_path
    for rate, chosen in ((0.95, head), (0.5, module)):
        (tmp_path / "acceptance.json").write_text(json.dumps({"acceptance_by_depth_and_rank": [[rate, 0.0]] * 5}))
        assert best_shipped([module, head]) is chosen
    assert best_shipped([module]) is module and best_shipped([]) is None


def test_mtp_tensors_of_an_unknown_layout_get_one_line():
    """MTP tensors for a model type whose layout is not known, or a module with a part
    this runtime does not know, are one line each, naming what to pass instead."""
    from synthetic import build_model, target_config

    qwen2 = build_model(target_config("qwen2", VOCAB))
    with pytest.raises(UserError, match=r"MTP tensors for a 'qwen2' model, whose MTP layout is not known here"):
        module_for(qwen2, {"mtp.fc.weight": mx.zeros((64, 128))}, "ckpt")
    model = build("qwen3_next")
    tensors = mtp_tensors(new_module(model)) | {"mtp.extra_proj.weight": mx.zeros((4, 4))}
    with pytest.raises(UserError, match=r"1 unexpected \(e.g. mtp.extra_proj.weight\); pass --draft lookup or none"):
        module_for(model, tensors, "ckpt")


def test_a_latent_attention_model_is_not_checked_as_llama(tmp_path):
    """GLM-4.7-Flash's hidden size is not a multiple of its heads (its head sizes are the
    latent attention's own): its directory loads and decodes on the tree path."""
    from mlx_eagle import load

    config = dict(EXPERT_CONFIGS["glm4_moe_lite"], num_attention_heads=3, num_key_value_heads=3)
    model, _ = load(str(write_directory(tmp_path, "glm4_moe_lite", config)))
    drafter = Composite([EagleDrafter(new_module(model), model, parse_tree("static:default")),
                         LookupDrafter(lambda k: 1.0)])
    tokens, _ = decode(model, drafter, count=20)
    assert tokens == reference(model, count=20)


@pytest.mark.parametrize("family", ["mimo", "deepseek_v3", "glm4_moe_lite"])
def test_the_modules_tree_is_drafted_alike_compiled_and_eager(family):
    """Where target.py drives the target, the module's static tree is drafted in one
    compiled call (trees.py), proposing exactly what the depth-by-depth draft proposes."""
    from mlx_eagle.drafters.tree_growth import TreeDrafter

    model = build(family)
    module = module_for(model, mtp_tensors(new_module(model), model), "test")
    cache = [KVCache()]
    rng = np.random.default_rng(1)
    hidden = mx.array(rng.standard_normal((1, 12, model.args.hidden_size)).astype(np.float32))
    out = module.step(model, hidden, mx.array(rng.integers(1, VOCAB, (1, 12))), cache, 0, "causal")
    compiled, eager = (TreeDrafter(module, model, parse_tree("static:default"), compiled=c) for c in (True, False))
    assert compiled.compiled is not None and eager.compiled is None
    drafted = [drafter.draft(out[:, -1], cache, 11)[1].tolist() for drafter in (compiled, eager)]
    assert drafted[0] == drafted[1] and cache[0].offset == 12


@pytest.mark.parametrize("family", ["mimo", "glm4_moe"])
def test_one_module_drafts_every_conversation_of_a_batch_together(family, monkeypatch):
    """Conversations of one batch sharing the model's MTP module (EagleDrafter's
    observe_together): each reply is plain decoding's, and the module steps once a depth for
    all of them, not once per conversation."""
    from mlx_eagle.decoder import SpeculativeDecoder, batched_round, batches
    from mlx_eagle.verify import Sampling
    from plain import plain_tokens

    model = build(family)
    module = module_for(model, mtp_tensors(new_module(model), model), "test")
    prompts = [[5, 17, 33, 5, 17, 60, 2, 9, 41, 17, 5, 17, 33], [1, 2, 3, 1, 2, 3, 1, 2], [9, 8, 7, 6, 5, 9, 8, 7, 6]]
    decoders = [SpeculativeDecoder(model, EagleDrafter(module, model, parse_tree("static:default")), Sampling())
                for _ in prompts]
    assert all(batches(decoder) for decoder in decoders)
    replies = [[decoder.prefill(prompt)] for decoder, prompt in zip(decoders, prompts)]
    steps = []
    step = type(module).step
    monkeypatch.setattr(type(module), "step", lambda self, *args: steps.append(1) or step(self, *args))
    rounds = 0
    while min(len(reply) for reply in replies) < 20:
        for reply, result in zip(replies, batched_round(decoders, [40] * len(decoders))):
            reply += result.tokens
        rounds += 1
    assert [reply[:20] for reply in replies] == [plain_tokens(model, prompt, 20) for prompt in prompts]
    per_round = 1 + sum(level.grows for level in decoders[0].drafter.grower.levels)  # a read, then a pass a depth
    assert len(steps) <= rounds * per_round < rounds * per_round * len(prompts)
