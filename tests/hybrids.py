"""Tiny hybrid and recurrent models of every family mlx-lm 0.32 loads, built from mlx-lm's
own classes with random weights: Gated DeltaNet (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, Kimi
Linear's delta attention), Mamba 2 (Mamba 2, Nemotron-H, Granite 4 hybrid, Falcon-H1),
Mamba (Jamba) and short convolutions (LFM2, LFM2-MoE), each mixed with attention layers
where the family has them."""

from __future__ import annotations

import importlib
import json
from typing import Dict

import mlx.core as mx
from mlx.utils import tree_map

from mlx_eagle.decoder import SpeculativeDecoder
from mlx_eagle.verify import Sampling
from plain import plain_tokens

VOCAB = 97
SMALL = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-6}
_GDN = {"linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "full_attention_interval": 2, "head_dim": 16}
_QWEN35_TEXT = dict(SMALL, **_GDN, num_hidden_layers=4, rope_parameters={
    "type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0, "partial_rotary_factor": 0.5})

FAMILIES: Dict[str, dict] = {
    "qwen3_next": dict(SMALL, **_GDN, model_type="qwen3_next", num_hidden_layers=4, num_experts=4,
                       num_experts_per_tok=2, decoder_sparse_step=1, shared_expert_intermediate_size=32,
                       mlp_only_layers=[], moe_intermediate_size=32, rope_theta=10000.0, partial_rotary_factor=0.5),
    "qwen3_5": {"model_type": "qwen3_5", "text_config": dict(_QWEN35_TEXT, model_type="qwen3_5_text")},
    "qwen3_5_moe": {"model_type": "qwen3_5_moe", "text_config": dict(
        _QWEN35_TEXT, model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2,
        shared_expert_intermediate_size=32, moe_intermediate_size=32)},
    "nemotron_h": dict(SMALL, model_type="nemotron_h", attention_bias=False, mamba_num_heads=4, mamba_head_dim=16,
                       mamba_proj_bias=False, ssm_state_size=16, conv_kernel=4, n_groups=1, mlp_bias=False,
                       layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True, hybrid_override_pattern="M-M*",
                       head_dim=16, time_step_limit=[0.0, float("inf")]),
    "granitemoehybrid": dict(SMALL, model_type="granitemoehybrid", num_hidden_layers=4, attention_bias=False,
                             embedding_multiplier=1.0, attention_multiplier=0.25, logits_scaling=1.0,
                             residual_multiplier=1.0, layer_types=["mamba", "attention", "mamba", "mamba"],
                             mamba_n_heads=4, mamba_d_head=16, mamba_proj_bias=False, mamba_d_state=16, mamba_d_conv=4,
                             mamba_n_groups=1, mamba_conv_bias=True, shared_intermediate_size=128),
    "falcon_h1": dict(SMALL, model_type="falcon_h1", num_hidden_layers=3, head_dim=16, mamba_d_conv=4,
                      mamba_d_head=16, mamba_d_ssm=64, mamba_d_state=16, mamba_n_heads=4, mamba_n_groups=1,
                      rope_theta=10000.0, tie_word_embeddings=False),
    "mamba2": {"model_type": "mamba2", "num_heads": 4, "head_dim": 16, "vocab_size": VOCAB, "hidden_size": 32,
               "intermediate_size": 64, "state_size": 16, "num_hidden_layers": 2, "layer_norm_epsilon": 1e-5,
               "conv_kernel": 4, "n_groups": 1, "use_bias": False, "use_conv_bias": True,
               "tie_word_embeddings": True, "time_step_limit": [0.0, float("inf")], "time_step_rank": 4},
    "jamba": dict(SMALL, model_type="jamba", num_hidden_layers=4, attn_layer_offset=1, attn_layer_period=2,
                  expert_layer_offset=1, expert_layer_period=2, mamba_d_conv=4, mamba_d_state=8, mamba_expand=2,
                  num_experts=4, num_experts_per_tok=2),
    "lfm2": dict(SMALL, model_type="lfm2", num_hidden_layers=4, norm_eps=1e-5, conv_bias=False, conv_L_cache=3,
                 block_dim=64, block_multiple_of=16, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False,
                 block_ff_dim=128, rope_theta=10000.0,
                 layer_types=["conv", "full_attention", "conv", "conv"]),
    "lfm2_moe": dict(SMALL, model_type="lfm2_moe", num_hidden_layers=4, moe_intermediate_size=32, num_experts=4,
                     num_experts_per_tok=2, norm_topk_prob=True, use_expert_bias=False, num_dense_layers=1,
                     norm_eps=1e-5, conv_bias=False, conv_L_cache=3, rope_theta=10000.0,
                     layer_types=["conv", "full_attention", "conv", "conv"]),
    "kimi_linear": dict(SMALL, model_type="kimi_linear", num_hidden_layers=2, head_dim=16, rope_theta=10000.0,
                        model_max_length=512, num_experts=4, moe_intermediate_size=32, kv_lora_rank=16,
                        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, num_experts_per_token=2,
                        first_k_dense_replace=1,
                        linear_attn_config={"kda_layers": [1], "full_attn_layers": [2], "num_heads": 4,
                                            "head_dim": 16, "short_conv_kernel_size": 4}),
}


def build(family: str, seed: int = 0, scale: float = 3.0, vocab_size: int = VOCAB):
    """A tiny ``family`` model with random weights: mlx-lm's own initialisation, its matrices
    scaled up so that the greedy text depends on the context (unscaled, some families repeat
    one token)."""
    config = json.loads(json.dumps(FAMILIES[family]))
    (config.get("text_config") or config)["vocab_size"] = config["vocab_size"] = vocab_size
    module = importlib.import_module(f"mlx_lm.models.{family}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    if scale != 1.0:
        model.update(tree_map(lambda p: p * scale if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    return model


PROMPT = [5, 17, 33, 5, 17, 60, 2, 9, 41, 17, 5, 17, 33, 5, 17, 60, 2, 9]  # a pattern to copy


COUNT = 60


def reference(model, prompt=PROMPT, count=COUNT):
    return plain_tokens(model, prompt, count)


def decode(model, drafter, prompt=PROMPT, count=COUNT, cache=None, replays=True):
    """Where the rollback replays (``replays``: as it does unless switched off), every round
    leaves no accepted token to read again."""
    decoder = SpeculativeDecoder(model, drafter, Sampling(), cache=cache)
    tokens = [decoder.prefill(prompt)]
    while len(tokens) < count:
        tokens += decoder.round(count - len(tokens)).tokens
        assert not (replays and decoder.rewind and decoder.rewind.replays) or decoder.state.unread == 0
    return tokens[:count], decoder


def write_directory(root, family: str, config: dict = None):
    """A tiny ``family`` model (of hybrids.py, or as ``config`` describes it) as an MLX
    model directory (as mlx-community publishes them), with a BPE tokenizer and a chat
    template."""
    import json

    from mlx.utils import tree_flatten

    import synthetic

    directory = root / family
    directory.mkdir()
    tokenizer = synthetic._bpe_tokenizer("qwen2")
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "chat_template": synthetic.CHATML}))
    config = json.loads(json.dumps(config or FAMILIES[family]))
    (config.get("text_config") or config)["vocab_size"] = config["vocab_size"] = tokenizer.get_vocab_size()
    (directory / "config.json").write_text(json.dumps(config))
    model = synthetic.build_model(config) if family not in FAMILIES else \
        build(family, vocab_size=tokenizer.get_vocab_size())
    mx.save_safetensors(str(directory / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return directory


def text_model(model):
    """What mlx_eagle.load hands the decoder: a multimodal wrapper's text model."""
    return model["language_model"] if "language_model" in model else model
