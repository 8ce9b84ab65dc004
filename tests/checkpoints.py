"""Drafters' checkpoints as their authors publish them, with random weights: DFlash block
drafters in the z-lab layout, DSpark block drafters in DeepSpec's, models' own MTP modules
under each family's names, and EAGLE heads under the official names, beside the tiny
targets they draft for."""

import json

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from hybrids import VOCAB
from mlx_eagle.mtp_model import LAYOUTS, MTPModule, new_decoder_layer
from mlx_eagle.target import inner_model


DFLASH_SIZES = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "intermediate_size": 96}


def tiny_target(seed: int = 0, vocab: int = 97, hidden: int = 64) -> llama.Model:
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs(model_type="llama", hidden_size=hidden, num_hidden_layers=6,
                                        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                        rms_norm_eps=1e-5, vocab_size=vocab, max_position_embeddings=512,
                                        tie_word_embeddings=False, rope_theta=10000.0))
    mx.eval(model.parameters())
    return model


def dflash_tensors(config: dict, target_hidden: int, rng) -> dict:
    """Random tensors under the z-lab checkpoint's names, float32 numpy."""
    def w(*shape):
        return (0.2 * rng.standard_normal(shape)).astype(np.float32)

    hidden, heads, kv, dim = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"], \
        config["head_dim"]
    inter = config["intermediate_size"]
    taps = len((config.get("dflash_config") or config)["target_layer_ids"])
    tensors = {"fc.weight": w(hidden, taps * target_hidden), "hidden_norm.weight": 1 + w(hidden),
               "norm.weight": 1 + w(hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": 1 + w(hidden), p + "post_attention_layernorm.weight": 1 + w(hidden),
            p + "self_attn.q_proj.weight": w(heads * dim, hidden), p + "self_attn.k_proj.weight": w(kv * dim, hidden),
            p + "self_attn.v_proj.weight": w(kv * dim, hidden), p + "self_attn.o_proj.weight": w(hidden, heads * dim),
            p + "self_attn.q_norm.weight": 1 + w(dim), p + "self_attn.k_norm.weight": 1 + w(dim),
            p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter)})
    return tensors


def write_dflash(directory, target, layer_ids, block=8, mask=3, seed=0, sizes=DFLASH_SIZES, **changes):
    """A DFlash checkpoint for ``target`` in the z-lab layout: config.json, model.safetensors."""
    from safetensors.numpy import save_file

    args = target.args
    config = dict(sizes, architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=args.hidden_size,
                  vocab_size=args.vocab_size, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096,
                  block_size=block, num_target_layers=args.num_hidden_layers,
                  dflash_config={"mask_token_id": mask, "target_layer_ids": list(layer_ids)})
    config.update(changes)
    tensors = dflash_tensors(config, args.hidden_size, np.random.default_rng(seed))
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"))
    return config, tensors


def refused_in_one_line(load, directory, target, config: dict, message: str) -> None:
    """``config`` written over the checkpoint's in ``directory``: ``load`` refuses it in one
    line matching ``message``."""
    import pytest

    from mlx_eagle.errors import UserError

    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=message) as caught:
        load(directory, target)
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 400


def write_dspark(directory, target, layer_ids, block=6, mask=3, rank=16, markov="vanilla", confidence=True,
                 with_markov=True, seed=0, sizes=DFLASH_SIZES, **changes):
    """A DSpark checkpoint for ``target`` as DeepSpec saves one: the target's Qwen3 config
    with the DSpark fields beside it, and model.safetensors holding the backbone, the
    Markov and confidence heads, and copies of the target's embedding and LM head."""
    from safetensors.numpy import save_file

    args = target.args
    config = dict(sizes, architectures=["Qwen3DSparkModel"], model_type="qwen3", hidden_size=args.hidden_size,
                  vocab_size=args.vocab_size, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096,
                  attention_bias=False, block_size=block, num_target_layers=args.num_hidden_layers,
                  target_layer_ids=list(layer_ids), mask_token_id=mask, num_anchors=512, markov_rank=rank,
                  markov_head_type=markov, enable_confidence_head=confidence, tie_word_embeddings=False,
                  layer_types=["full_attention"] * sizes["num_hidden_layers"])
    if confidence:
        config["confidence_head_with_markov"] = with_markov
    config.update(changes)
    rng = np.random.default_rng(seed)
    tensors = dflash_tensors(config, args.hidden_size, rng)
    hidden, vocab = args.hidden_size, args.vocab_size

    def w(*shape):
        return (0.5 * rng.standard_normal(shape)).astype(np.float32)

    tensors.update({"markov_head.markov_w1.weight": w(vocab, rank), "markov_head.markov_w2.weight": w(vocab, rank)})
    embedding = inner_model(target).embed_tokens.weight
    if mx.issubdtype(embedding.dtype, mx.floating):  # (a quantized target's are not copied)
        head = target.lm_head.weight if "lm_head" in target else embedding
        tensors.update({"embed_tokens.weight": np.array(embedding, dtype=np.float32),
                        "lm_head.weight": np.array(head, dtype=np.float32)})
    if markov == "gated":
        tensors.update({"markov_head.gate_proj.weight": w(rank, hidden + rank), "markov_head.gate_proj.bias": w(rank)})
    if markov == "rnn":
        tensors.update({"markov_head.joint_proj.weight": w(3 * rank, 2 * rank + hidden),
                        "markov_head.joint_proj.bias": w(3 * rank)})
    if confidence:
        tensors.update({"confidence_head.proj.weight": w(1, hidden + (rank if with_markov else 0)),
                        "confidence_head.proj.bias": w(1)})
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"))
    return config, tensors


# DeepSeek-V3, GLM-4.5 and GLM-4.7-Flash, tiny: multi-head latent attention (DeepSeek's and
# GLM-4.7-Flash's), experts routed by a biased sigmoid gate with a shared expert, a dense
# first layer.
_EXPERTS = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1,
            "n_routed_experts": 4, "routed_scaling_factor": 1.5, "num_experts_per_tok": 2, "n_group": 1,
            "topk_group": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1, "norm_topk_prob": True,
            "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
            "tie_word_embeddings": False, "attention_bias": False, "num_nextn_predict_layers": 1}


_LATENT = {"kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16}


EXPERT_CONFIGS = {
    "deepseek_v3": dict(_EXPERTS, **_LATENT, model_type="deepseek_v3"),
    "glm4_moe": dict(_EXPERTS, model_type="glm4_moe", head_dim=16, use_qk_norm=True, partial_rotary_factor=0.5),
    "glm4_moe_lite": dict(_EXPERTS, **_LATENT, model_type="glm4_moe_lite"),
}


def new_module(model, seed: int = 3) -> MTPModule:
    """A random MTP module for ``model`` (a decoder layer of its own kind)."""
    mx.random.seed(seed)
    layout = LAYOUTS[model.args.model_type]
    module = MTPModule(model, new_decoder_layer(model, after=layout.after_layers), layout)
    mx.eval(module.parameters())
    return module


def mtp_tensors(module: MTPModule, model=None) -> dict:
    """The module as a checkpoint of its family names it (Qwen's names are ours): MiMo's
    under model.mtp_layers.0; DeepSeek's and GLM's under model.layers.{layer count}, with
    their experts one by one and copies of ``model``'s embedding and LM head."""
    ours = {f"mtp.{name}": value for name, value in tree_flatten(module.parameters())}
    if module.layout is LAYOUTS["qwen3_next"]:
        return ours
    if module.layout.hidden_first:
        prefix, parts = "model.mtp_layers.0.", {"fc.": "input_proj.", "pre_fc_norm_embedding.": "token_layernorm.",
                                                "pre_fc_norm_hidden.": "hidden_layernorm.", "norm.": "final_layernorm.",
                                                "layers.0.": ""}
    else:
        prefix = f"model.layers.{len(inner_model(model).layers)}."
        parts = {"fc.": "eh_proj.", "pre_fc_norm_embedding.": "enorm.", "pre_fc_norm_hidden.": "hnorm.",
                 "norm.": "shared_head.norm.", "layers.0.": ""}
    named = {}
    for name, value in ours.items():
        name = name[len("mtp."):]
        part = next(p for p in parts if name.startswith(p))
        name = f"{prefix}{parts[part]}{name[len(part):]}"
        if ".switch_mlp." in name:
            for expert in range(value.shape[0]):
                named[name.replace("switch_mlp.", f"experts.{expert}.")] = value[expert]
        else:
            named[name] = value
    if not module.layout.hidden_first:
        named[f"{prefix}embed_tokens.weight"] = inner_model(model).embed_tokens.weight
        named[f"{prefix}shared_head.head.weight"] = model.lm_head.weight
    return named


HEAD = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "rms_norm_eps": 1e-5, "max_position_embeddings": 256}


DRAFT_VOCAB = 100


def official_tensors(family, target_embed, rng, qkv_bias=False, fc_bias=False, own_embedding=False,
                     prefix="midlayer", hidden=64):
    """Random tensors under the official names, float32 numpy."""
    def w(*shape):
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)

    heads, kv, head_dim, inter = 4, 2, 16, 96
    wide = 2 * hidden if family == "eagle3" else hidden
    layer = prefix if family == "eagle3" else "layers.0"
    t = {
        f"{layer}.self_attn.q_proj.weight": w(heads * head_dim, wide),
        f"{layer}.self_attn.k_proj.weight": w(kv * head_dim, wide),
        f"{layer}.self_attn.v_proj.weight": w(kv * head_dim, wide),
        f"{layer}.self_attn.o_proj.weight": w(hidden, heads * head_dim),
        f"{layer}.mlp.gate_proj.weight": w(inter, hidden),
        f"{layer}.mlp.up_proj.weight": w(inter, hidden),
        f"{layer}.mlp.down_proj.weight": w(hidden, inter),
        f"{layer}.post_attention_layernorm.weight": 1 + w(hidden),
    }
    if qkv_bias:
        for name in ("q", "k", "v"):
            t[f"{layer}.self_attn.{name}_proj.bias"] = w(t[f"{layer}.self_attn.{name}_proj.weight"].shape[0])
    vocab = target_embed.shape[0]
    if family == "eagle3":
        used = np.sort(rng.choice(vocab, DRAFT_VOCAB, replace=False))
        t2d = np.zeros(vocab, dtype=bool)
        t2d[used] = True
        t.update({"fc.weight": w(hidden, 3 * hidden), f"{layer}.input_layernorm.weight": 1 + w(hidden),
                  f"{layer}.hidden_norm.weight": 1 + w(hidden), "norm.weight": 1 + w(hidden),
                  "lm_head.weight": w(DRAFT_VOCAB, hidden), "d2t": (used - np.arange(DRAFT_VOCAB)).astype(np.int64),
                  "t2d": t2d})
    else:
        t["fc.weight"] = w(hidden, 2 * hidden)
        if fc_bias:
            t["fc.bias"] = w(hidden)
        t["embed_tokens.weight"] = w(vocab, hidden) if own_embedding else target_embed.copy()
    return t


def write_checkpoint(directory, tensors, config, fmt):
    """As published: config.json plus pytorch_model.bin / model.safetensors / shards + index."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    if fmt == "bin":
        import torch

        torch.save({k: torch.from_numpy(v) for k, v in tensors.items()}, directory / "pytorch_model.bin")
    elif fmt == "safetensors":
        save_file(tensors, str(directory / "model.safetensors"))
    else:
        names = sorted(tensors)
        shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        for file, keys in shards.items():
            save_file({k: tensors[k] for k in keys}, str(directory / file))
        index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index))
