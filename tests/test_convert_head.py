"""Converting published EAGLE heads: checkpoints written by the tests in the published
layouts and file formats (pytorch_model.bin as PyTorch writes it, safetensors, sharded
safetensors) for llama and qwen2 targets give the draft logits an independent numpy
reference computes from the original tensors; export and convert back is the identity;
a pickle that calls anything but tensor rebuilding is refused before it runs; a head for
another target fails with one line; a converted head keeps greedy decoding lossless."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from mlx_eagle.convert.export import export_head
from mlx_eagle.convert.head import convert_head, main
from mlx_eagle.errors import UserError
from mlx_eagle.heads import load_head
from synthetic import write_model
from plain import plain_tokens
from checkpoints import DRAFT_VOCAB, HEAD, official_tensors, write_checkpoint


# An independent reference, in numpy, from the original tensors.
def rms(x, w, eps=1e-5):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x, theta):
    half = x.shape[-1] // 2
    angles = np.arange(x.shape[1])[:, None] / theta ** (np.arange(half) / half)
    cos, sin = np.cos(np.concatenate([angles] * 2, -1)), np.sin(np.concatenate([angles] * 2, -1))
    return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin


def attention(t, layer, x, theta):
    def proj(name, heads):
        y = x @ t[f"{layer}.self_attn.{name}_proj.weight"].T + t.get(f"{layer}.self_attn.{name}_proj.bias", 0)
        return y.reshape(len(x), heads, 16).transpose(1, 0, 2)

    q, k, v = rope(proj("q", 4), theta), rope(proj("k", 2), theta), proj("v", 2)
    k, v = np.repeat(k, 2, axis=0), np.repeat(v, 2, axis=0)
    scores = q @ k.transpose(0, 2, 1) / 4.0 + np.triu(np.full((len(x), len(x)), -np.inf), 1)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    out = (weights / weights.sum(-1, keepdims=True)) @ v
    return out.transpose(1, 0, 2).reshape(len(x), -1) @ t[f"{layer}.self_attn.o_proj.weight"].T


def mlp(t, layer, x):
    gate = x @ t[f"{layer}.mlp.gate_proj.weight"].T
    up = x @ t[f"{layer}.mlp.up_proj.weight"].T
    return (gate / (1 + np.exp(-gate)) * up) @ t[f"{layer}.mlp.down_proj.weight"].T


def reference_logits(family, t, target_embed, features, tokens, theta, norm_before_residual=False):
    """Draft logits over target ids (EAGLE-3: scattered through d2t, -inf elsewhere).
    ``norm_before_residual``: speculators' variant, the residual is the normed hidden."""
    if family == "eagle1":
        embedding = t["embed_tokens.weight"][tokens]
        x = np.concatenate([embedding, features], -1) @ t["fc.weight"].T + t.get("fc.bias", 0)
        h = x + attention(t, "layers.0", x, theta)
        out = h + mlp(t, "layers.0", rms(h, t["layers.0.post_attention_layernorm.weight"]))
        return out @ target_embed.T
    layer = "midlayer" if "midlayer.hidden_norm.weight" in t else "layers.0"
    if "input_norm.weight" in t:
        features = rms(features, t["input_norm.weight"])
    hidden = features @ t["fc.weight"].T + t.get("fc.bias", 0)
    normed = rms(hidden, t[f"{layer}.hidden_norm.weight"])
    embedding = t.get("embed_tokens.weight", target_embed)[tokens]
    x = np.concatenate([rms(embedding, t[f"{layer}.input_layernorm.weight"]), normed], -1)
    h = (normed if norm_before_residual else hidden) + attention(t, layer, x, theta)
    out = h + mlp(t, layer, rms(h, t[f"{layer}.post_attention_layernorm.weight"]))
    draft = rms(out, t["norm.weight"]) @ t["lm_head.weight"].T
    full = np.full((len(tokens), target_embed.shape[0]), -np.inf, dtype=np.float32)
    full[:, np.arange(draft.shape[1]) + t.get("d2t", 0)] = draft
    return full


def mlx_logits(head, target, features, tokens):
    out = head.step(target, head.project(mx.array(features)[None]), mx.array(tokens)[None], [KVCache()], 0, "causal")
    logits = head.logits(target, out)[0].astype(mx.float32)
    if head.family == "eagle1":
        return np.array(logits)
    full = np.full((len(tokens), target.args.vocab_size), -np.inf, dtype=np.float32)
    full[:, np.array(head.target_ids(mx.arange(logits.shape[-1])))] = np.array(logits)
    return full


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    from mlx_eagle.convert.target import convert_target
    from mlx_eagle import load

    root = tmp_path_factory.mktemp("head-targets")
    result = {}
    for arch in ("llama", "qwen2"):
        written = write_model(root, arch)
        path = convert_target(written["hf"], root / f"{arch}-mlx", progress=False)
        model, _ = load(str(path))
        embed = np.array(mx.load(str(written["hf"] / "model.safetensors"))["model.embed_tokens.weight"])
        result[arch] = (path, model, embed)
    return result


CASES = [  # (target, family, file format, variant)
    ("llama", "eagle3", "bin", "midlayer"),
    ("llama", "eagle3", "safetensors", "layers.0 naming, no rope_theta"),
    ("llama", "eagle1", "sharded", "embedding copied from the target"),
    ("qwen2", "eagle3", "sharded", "qkv biases"),
    ("qwen2", "eagle1", "bin", "fc bias, own embedding"),
]


@pytest.mark.parametrize("arch, family, fmt, variant", CASES)
def test_converted_heads_draft_as_the_numpy_reference(targets, tmp_path, arch, family, fmt, variant):
    path, model, embed = targets[arch]
    rng = np.random.default_rng(len(variant))
    tensors = official_tensors(family, embed, rng, qkv_bias="qkv" in variant, fc_bias="fc bias" in variant,
                               own_embedding="own" in variant,
                               prefix="layers.0" if "layers.0" in variant else "midlayer")
    config = dict(HEAD, vocab_size=embed.shape[0], architectures=["LlamaForCausalLM"])
    if "no rope_theta" not in variant:
        config["rope_theta"] = 5000.0
    if family == "eagle3":
        config.update(draft_vocab_size=DRAFT_VOCAB, target_hidden_size=64, architectures=["LlamaForCausalLMEagle3"])
    write_checkpoint(tmp_path / "published", tensors, config, fmt)
    out = convert_head(str(tmp_path / "published"), tmp_path / "mlx-head", target=str(path))
    head = load_head(out, model)
    assert ("embed_tokens" in head) == ("own" in variant)
    width = 3 * 64 if family == "eagle3" else 64
    features = rng.standard_normal((7, width)).astype(np.float32)
    tokens = rng.integers(0, embed.shape[0], size=7)
    theta = config.get("rope_theta", 10000.0)
    expected = reference_logits(family, tensors, embed, features, tokens, theta)
    got = mlx_logits(head, model, features, tokens)
    finite = np.isfinite(expected)
    assert np.array_equal(finite, np.isfinite(got))
    assert np.abs(got[finite] - expected[finite]).max() < 1e-4

    # Export to the official layout and convert back: the same weights, the same drafts.
    export_head(out, tmp_path / "exported")
    exported = mx.load(str(tmp_path / "exported" / "model.safetensors"))
    if family == "eagle3":
        assert exported["t2d"].dtype == mx.bool_ and np.array_equal(np.array(exported["t2d"]), tensors["t2d"])
    again = convert_head(str(tmp_path / "exported"), tmp_path / "again", target=str(path))
    first, second = mx.load(str(out / "model.safetensors")), mx.load(str(again / "model.safetensors"))
    assert set(first) == set(second) and all(mx.array_equal(first[k], second[k]) for k in first)
    assert np.array_equal(mlx_logits(load_head(again, model), model, features, tokens), got)


# Each tool's layout, written from the official tensors: (tensors, config, reference options).
def _renamed(tensors, old, new):
    return {(new + k[len(old):] if k.startswith(old) else k): v for k, v in tensors.items()}


def specforge(t, config):
    """SpecForge: the official layout and names; Llama 3 RoPE scaling in the config, which
    SpecForge's draft layer (and the official code's) does not apply."""
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    return t, dict(config, architectures=["LlamaForCausalLMEagle3"], rope_scaling=rope,
                   eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 3]}), {}


def angelslim(t, config):
    """AngelSlim: the official layout; its config is the target's, with draft_vocab_size."""
    config = {k: v for k, v in config.items() if k != "target_hidden_size"}
    return t, dict(config, architectures=["Eagle3LlamaForCausalLM"], tie_word_embeddings=True, rope_scaling=None,
                   hidden_act="silu", num_hidden_layers=1), {}


def speculators_eagle3(t, config):
    """vLLM speculators: layers.0, fc with a bias, an input norm over the taps, the residual
    taken after hidden_norm, an embedding of its own (trained, embed_requires_grad), the
    layer's config nested (only what differs from transformers' defaults), and the
    verifier's norm and LM head left in from training."""
    rng = np.random.default_rng(11)
    t = _renamed(t, "midlayer.", "layers.0.")
    t = dict(t, **{"fc.bias": (0.1 * rng.standard_normal(64)).astype(np.float32),
                   "embed_tokens.weight": (0.1 * rng.standard_normal((config["vocab_size"], 64))).astype(np.float32),
                   "input_norm.weight": (1 + 0.1 * rng.standard_normal(192)).astype(np.float32),
                   "verifier_norm.weight": np.ones(64, np.float32),
                   "verifier_lm_head.weight": np.zeros((DRAFT_VOCAB, 64), np.float32)})
    layer = {k: config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                    "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size", "rope_theta")}
    nested = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
              "transformer_layer_config": dict(layer, model_type="llama", num_hidden_layers=1),
              "draft_vocab_size": DRAFT_VOCAB, "target_hidden_size": 64, "norm_before_residual": True,
              "norm_before_fc": True, "embed_requires_grad": True, "eagle_aux_hidden_state_layer_ids": [0, 1, 3],
              "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "tiny"}}}
    return t, nested, {"norm_before_residual": True}


def modelopt(t, config):
    """NVIDIA Model Optimizer: layers.0, no embedding, no t2d, the head over the whole
    vocabulary (its LM head, no d2t), flags in eagle_config."""
    rng = np.random.default_rng(12)
    t = {k: v for k, v in _renamed(t, "midlayer.", "layers.0.").items()
         if k not in ("t2d", "d2t", "embed_tokens.weight")}
    t["lm_head.weight"] = (0.1 * rng.standard_normal((config["vocab_size"], 64))).astype(np.float32)
    flags = {"eagle_aux_hidden_state_layer_ids": [0, 1, 3], "use_aux_hidden_state": True,
             "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True, "use_mtp_layernorm": False,
             "next_layer_regular": True, "parallel_draft_step": 1, "parallel_draft_heads_num_layers": None}
    config = dict(config, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=config["vocab_size"],
                  num_hidden_layers=1, eagle_config=flags)
    return t, config, {}


def fused(t, config):
    """Fused projections, as some exporters write them: qkv_proj and gate_up_proj."""
    t = dict(t)
    qkv = [t.pop(f"midlayer.self_attn.{p}_proj.weight") for p in "qkv"]
    t["midlayer.self_attn.qkv_proj.weight"] = np.concatenate(qkv)
    t["midlayer.mlp.gate_up_proj.weight"] = np.concatenate([t.pop("midlayer.mlp.gate_proj.weight"),
                                                           t.pop("midlayer.mlp.up_proj.weight")])
    return t, config, {}


def speculators_eagle(t, config):
    """vLLM speculators' EAGLE-1: fusion_fc (with a bias) and transformer; the embedding
    and LM head are the verifier's and not saved."""
    rng = np.random.default_rng(13)
    t = {k: v for k, v in _renamed(_renamed(t, "fc.", "fusion_fc."), "layers.0.", "transformer.").items()
         if k != "embed_tokens.weight"}
    t["fusion_fc.bias"] = (0.1 * rng.standard_normal(64)).astype(np.float32)
    layer = {k: config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                    "head_dim", "rms_norm_eps", "vocab_size", "rope_theta")}
    return t, {"speculators_model_type": "eagle", "layernorms": False, "fusion_bias": True,
               "transformer_layer_config": dict(layer, model_type="llama", num_hidden_layers=1)}, {}


LAYOUTS = [("eagle3", specforge), ("eagle3", angelslim), ("eagle3", speculators_eagle3), ("eagle3", modelopt),
           ("eagle3", fused), ("eagle1", speculators_eagle)]


@pytest.mark.parametrize("family, layout", LAYOUTS, ids=[layout.__name__ for _, layout in LAYOUTS])
def test_every_published_layout_drafts_as_the_numpy_reference(targets, tmp_path, family, layout):
    path, model, embed = targets["llama"]
    rng = np.random.default_rng(7)
    base = official_tensors(family, embed, rng)
    config = dict(HEAD, vocab_size=embed.shape[0], rope_theta=5000.0)
    if family == "eagle3":
        config.update(draft_vocab_size=DRAFT_VOCAB, target_hidden_size=64)
    tensors, config, options = layout(base, config)
    write_checkpoint(tmp_path / "published", tensors, config, "safetensors")
    head = load_head(convert_head(str(tmp_path / "published"), tmp_path / "mlx-head", target=str(path)), model)
    if "eagle_aux_hidden_state_layer_ids" in json.dumps(config):
        assert head.taps(4) == (0, 1, 3)
    reference = {k: v for k, v in _renamed(tensors, "layers.0.", "midlayer.").items()} if family == "eagle3" else \
        _renamed(_renamed(tensors, "fusion_fc.", "fc."), "transformer.", "layers.0.")
    if layout is fused:
        reference = base
    if "embed_tokens.weight" not in reference and family == "eagle1":
        reference["embed_tokens.weight"] = embed
    features = rng.standard_normal((7, 192 if family == "eagle3" else 64)).astype(np.float32)
    tokens = rng.integers(0, embed.shape[0], size=7)
    expected = reference_logits(family, reference, embed, features, tokens, 5000.0, **options)
    got = mlx_logits(head, model, features, tokens)
    finite = np.isfinite(expected)
    assert np.array_equal(finite, np.isfinite(got))
    assert np.abs(got[finite] - expected[finite]).max() < 1e-4
    # Exported to the official layout (with speculators' flags where it needs them) and back: the same drafts.
    export_head(tmp_path / "mlx-head", tmp_path / "exported")
    again = load_head(convert_head(str(tmp_path / "exported"), tmp_path / "again", target=str(path)), model)
    assert np.array_equal(mlx_logits(again, model, features, tokens), got)


@pytest.mark.parametrize("layout, change, message", [
    (speculators_eagle, {"layernorms": True}, "layernorms true"),
    (speculators_eagle3, {"speculators_model_type": "mlp"}, "'mlp' is not an EAGLE head"),
    (speculators_eagle3, {"transformer_layer_config": {"model_type": "llama", "num_hidden_layers": 2}},
     "2 decoder layers"),
    (modelopt, {"eagle_config": {"use_aux_hidden_state": True, "parallel_draft_step": 3}}, "parallel_draft_step is 3"),
    (modelopt, {"eagle_config": {"use_aux_hidden_state": True, "use_mtp_layernorm": True}}, "use_mtp_layernorm"),
    (specforge, {"quantization_config": {"quant_method": "modelopt"}}, r"quantized \(modelopt\)"),
    (specforge, {"tensor": "midlayer.self_attn.rotary_emb.inv_freq"}, "unexpected midlayer.self_attn.rotary_emb"),
])
def test_an_unknown_setting_or_key_is_named_in_one_line(targets, tmp_path, layout, change, message):
    path, _, embed = targets["llama"]
    family = "eagle1" if layout is speculators_eagle else "eagle3"
    config = dict(HEAD, vocab_size=embed.shape[0], rope_theta=5000.0, draft_vocab_size=DRAFT_VOCAB)
    tensors, config, _ = layout(official_tensors(family, embed, np.random.default_rng(0)), config)
    change = dict(change)
    if "tensor" in change:
        tensors[change.pop("tensor")] = np.ones(8, np.float32)
    config.update(change)
    write_checkpoint(tmp_path / "published", tensors, config, "safetensors")
    with pytest.raises(UserError, match=message) as caught:
        convert_head(str(tmp_path / "published"), tmp_path / "out", target=str(path))
    assert "\n" not in str(caught.value) and not (tmp_path / "out").exists()


def test_quantized_conversion_stays_close(targets, tmp_path):
    path, model, embed = targets["llama"]
    rng = np.random.default_rng(5)
    tensors = official_tensors("eagle3", embed, rng)
    config = dict(HEAD, vocab_size=embed.shape[0], draft_vocab_size=DRAFT_VOCAB, rope_theta=10000.0)
    write_checkpoint(tmp_path / "published", tensors, config, "safetensors")
    out = convert_head(str(tmp_path / "published"), tmp_path / "q8", target=str(path), q_bits=8, q_group_size=32)
    assert "midlayer.mlp.gate_proj.scales" in mx.load(str(out / "model.safetensors"))
    head = load_head(out, model)
    # on a CPU the runtime widens it to float32, where quantized matmuls are ~3x slower
    assert ("scales" in head.midlayer.mlp.gate_proj) == (mx.default_device() != mx.cpu)
    features = rng.standard_normal((5, 192)).astype(np.float32)
    tokens = rng.integers(0, embed.shape[0], size=5)
    expected = reference_logits("eagle3", tensors, embed, features, tokens, 10000.0)
    got = mlx_logits(head, model, features, tokens)
    finite = np.isfinite(expected)
    assert np.abs(got[finite] - expected[finite]).max() < 0.05 * np.abs(expected[finite]).max()


class Payload:
    """What a malicious checkpoint pickles: a call to os.system."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_a_pickle_that_calls_anything_else_is_refused(tmp_path, targets):
    import torch

    marker = tmp_path / "pwned"
    directory = tmp_path / "evil"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(dict(HEAD, vocab_size=384)))
    torch.save({"fc.weight": torch.zeros(2, 2), "x": Payload(marker)}, directory / "pytorch_model.bin")
    with pytest.raises(UserError, match=r"refused: its pickle asks for (posix|os)\.system"):
        convert_head(str(directory), tmp_path / "out", target=str(targets["llama"][0]))
    assert not marker.exists() and not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.partial-*"))


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": 32}, "hidden size 32 vs the target's 64"),
    ({"vocab_size": 999}, "vocabulary 999 vs the target's"),
])
def test_a_head_for_another_target_fails_with_one_line(targets, tmp_path, capsys, change, message):
    path, _, embed = targets["llama"]
    rng = np.random.default_rng(0)
    tensors = official_tensors("eagle3", embed, rng, hidden=change.get("hidden_size", 64))
    config = {**HEAD, "vocab_size": embed.shape[0], "draft_vocab_size": DRAFT_VOCAB, **change}
    write_checkpoint(tmp_path / "published", tensors, config, "safetensors")
    with pytest.raises(UserError, match=message) as caught:
        main([str(tmp_path / "published"), str(tmp_path / "out"), "--target", str(path)])
    assert "\n" not in str(caught.value) and not (tmp_path / "out").exists()


def test_a_converted_head_keeps_greedy_decoding_lossless(tmp_path, smollm):
    """A published-layout EAGLE-3 head for the real SmolLM2 (random weights), converted
    with 8-bit quantization, drafting through the runtime: exactly mlx-lm's greedy text."""

    from mlx_eagle import stream_generate

    model, tokenizer = smollm
    rng = np.random.default_rng(3)
    hidden, vocab, draft_vocab = 576, model.args.vocab_size, 512

    def w(*shape):
        return (0.05 * rng.standard_normal(shape)).astype(np.float32)

    used = np.sort(rng.choice(vocab, draft_vocab, replace=False))
    tensors = {"fc.weight": w(hidden, 3 * hidden), "norm.weight": 1 + w(hidden),
               "lm_head.weight": w(draft_vocab, hidden),
               "d2t": (used - np.arange(draft_vocab)).astype(np.int64),
               "midlayer.self_attn.q_proj.weight": w(576, 2 * hidden),
               "midlayer.self_attn.k_proj.weight": w(192, 2 * hidden),
               "midlayer.self_attn.v_proj.weight": w(192, 2 * hidden),
               "midlayer.self_attn.o_proj.weight": w(hidden, 576),
               "midlayer.mlp.gate_proj.weight": w(512, hidden), "midlayer.mlp.up_proj.weight": w(512, hidden),
               "midlayer.mlp.down_proj.weight": w(hidden, 512)}
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        tensors[f"midlayer.{norm}.weight"] = 1 + w(hidden)
    config = {"hidden_size": hidden, "intermediate_size": 512, "num_attention_heads": 9, "num_key_value_heads": 3,
              "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "vocab_size": vocab, "draft_vocab_size": draft_vocab}
    write_checkpoint(tmp_path / "published", tensors, config, "bin")
    head = load_head(convert_head(str(tmp_path / "published"), tmp_path / "head", q_bits=8), model)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Name three fruits."}],
                                           add_generation_prompt=True)
    expected = plain_tokens(model, prompt, 24, tokenizer.eos_token_ids)
    got = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=24, draft=head, tree="static:default")]
    assert got == expected
