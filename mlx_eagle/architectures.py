"""The architectures this runtime knows: one record per mlx-lm model type, holding what
target.py, the converters and the config checks need to know about it.

Adding an architecture is one record here (and its tests, tests/test_targets.py): the
mlx-lm module that builds it, the names its attention module gives its sizes, its
feed-forward block, its Hugging Face class and, where llama.cpp writes it, its GGUF
architecture. Records marked ``driven=False`` (the hybrid and recurrent families) convert
and load, and speculate with chains verified by the model's own forward pass, a
recurrent state rolled back by rewind.py. Every model mlx-lm loads drafts from the context
without a record.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from .errors import UserError


@dataclass(frozen=True)
class Architecture:
    model_type: str  # config.json's, as mlx-lm knows it
    module: str  # mlx_lm.models.<module> builds it
    hf_class: str  # config.json's architectures[0], written by the converters
    # (query heads, key/value heads, softmax scale): what its attention module calls them
    attention: Tuple[str, str, str] = ("n_heads", "n_kv_heads", "scale")
    feed_forward: str = "mlp"  # the decoder layer's MLP or mixture of experts
    gguf: Optional[str] = None  # llama.cpp's general.architecture, where the GGUF converter reads it
    gguf_permuted: bool = False  # llama.cpp reorders its Q and K rows for its RoPE layout
    # llama.cpp's tensor names that mean something else here than in llama (GGUF block name part, or
    # whole name, -> ours)
    gguf_names: Tuple[Tuple[str, str], ...] = ()
    gguf_layers: str = "model.layers"  # where its blocks' tensors go
    gguf_norm_shift: float = 0.0  # llama.cpp stores RMSNorm weights as w + shift for (1 + w) norms
    gguf_conv: Optional[str] = None  # the names of depthwise conv kernels llama.cpp stores squeezed to 2-D
    gguf_mamba2: bool = False  # llama.cpp's Mamba-2 layout: A as -exp(A_log), A and D as columns, norms per group
    gguf_gated_delta: bool = False  # llama.cpp's Gated DeltaNet layout: A as -exp(A_log), value heads tiled
    experts: bool = False  # a mixture of experts: GGUF files of it are refused (other formats convert)
    embedding_scale: bool = False  # embeddings are multiplied by sqrt(hidden) (rounded to bfloat16, as mlx-lm does)
    text_model: Optional[str] = None  # a multimodal wrapper: the attribute holding the text model, which is loaded
    text_config: Optional[str] = None  # ... and the config.json key holding its config
    driven: bool = True  # target.py drives its layers (trees, feature taps); False: chains through its own forward
    recurrent: bool = False  # recurrent layers (hybrid families): their state rolled back by rewind.py
    latent_attention: bool = False  # multi-head latent attention: heads sized by latent dimensions, not hidden/heads

    @property
    def llama_shaped(self) -> bool:
        """Whether a config of it is checked as llama's (head sizes from hidden / heads)."""
        return self.driven and not self.latent_attention


def _mamba2_gguf(mixer: str) -> Tuple[Tuple[str, str], ...]:
    """llama.cpp's names for a Mamba-2 mixer's tensors, as Hugging Face names them under ``mixer``."""
    return (("ssm_in", f"{mixer}.in_proj"), ("ssm_conv1d", f"{mixer}.conv1d"), ("ssm_dt.bias", f"{mixer}.dt_bias"),
            ("ssm_a", f"{mixer}.A_log"), ("ssm_d", f"{mixer}.D"), ("ssm_norm", f"{mixer}.norm"),
            ("ssm_out", f"{mixer}.out_proj"))


# Mamba 2's and Nemotron-H's: under "backbone", the embeddings and final norm too.
_MAMBA2_GGUF = (("token_embd.weight", "backbone.embeddings.weight"), ("output_norm.weight", "backbone.norm_f.weight"),
                ("attn_norm", "norm"), *_mamba2_gguf("mixer"))

ARCHITECTURES: Dict[str, Architecture] = {record.model_type: record for record in (
    Architecture("llama", "llama", "LlamaForCausalLM", gguf="llama", gguf_permuted=True),
    Architecture("mistral", "llama", "MistralForCausalLM"),  # mlx-lm runs mistral as llama; its GGUFs say llama
    Architecture("qwen2", "qwen2", "Qwen2ForCausalLM", gguf="qwen2"),
    Architecture("qwen3", "qwen3", "Qwen3ForCausalLM", gguf="qwen3"),
    Architecture("qwen3_moe", "qwen3_moe", "Qwen3MoeForCausalLM", gguf="qwen3moe", experts=True),
    Architecture("mixtral", "mixtral", "MixtralForCausalLM", ("num_heads", "num_key_value_heads", "scale"),
                 "block_sparse_moe", experts=True),
    Architecture("gpt_oss", "gpt_oss", "GptOssForCausalLM", ("num_attention_heads", "num_key_value_heads", "sm_scale"),
                 gguf="gpt-oss", experts=True),
    # Gemma 3: sliding-window and global layers (windows applied as masks), (1 + w) norms, a
    # normed output per sublayer, scaled embeddings and query pre-scaling (the attention's scale).
    Architecture("gemma3_text", "gemma3_text", "Gemma3ForCausalLM", gguf="gemma3", embedding_scale=True,
                 gguf_names=(("post_attention_norm", "post_attention_layernorm"),
                             ("ffn_norm", "pre_feedforward_layernorm"),
                             ("post_ffw_norm", "post_feedforward_layernorm")),
                 gguf_norm_shift=1.0),
    Architecture("gemma3", "gemma3", "Gemma3ForConditionalGeneration", text_model="language_model",
                 text_config="text_config"),
    Architecture("mimo", "mimo", "MiMoForCausalLM"),  # Qwen2's layers (and an MTP module: mtp_model.py)
    # GLM-4.5/4.6: per-head QK norms, partial RoPE, experts (and an MTP module: mtp_model.py).
    Architecture("glm4_moe", "glm4_moe", "Glm4MoeForCausalLM", experts=True),
    # DeepSeek-V3 and GLM-4.7-Flash: multi-head latent attention (target.py's _latent_attention),
    # experts routed by a biased sigmoid gate (and an MTP module: mtp_model.py).
    *(Architecture(model_type, model_type, hf_class, experts=True, latent_attention=True)
      for model_type, hf_class in (("deepseek_v3", "DeepseekV3ForCausalLM"),
                                   ("glm4_moe_lite", "Glm4MoeLiteForCausalLM"))),
    # Hybrid and recurrent families: Gated DeltaNet, Mamba 2, Mamba and short-convolution layers
    # (with attention layers in most), their state rolled back by rewind.py.
    # Qwen3.5 GGUFs (dense): llama.cpp's names for the Gated DeltaNet layers, its layout of
    # them, and squeezed conv kernels; it writes norms as the (1 + w) they apply, as mlx-lm does.
    Architecture("qwen3_5", "qwen3_5", "Qwen3_5ForConditionalGeneration", driven=False, recurrent=True,
                 text_model="language_model",
                 text_config="text_config", gguf="qwen35", gguf_conv="linear_attn.conv1d.weight",
                 gguf_gated_delta=True, gguf_names=(
                     ("attn_qkv", "linear_attn.in_proj_qkv"), ("attn_gate", "linear_attn.in_proj_z"),
                     ("ssm_beta", "linear_attn.in_proj_b"), ("ssm_alpha", "linear_attn.in_proj_a"),
                     ("ssm_a", "linear_attn.A_log"), ("ssm_dt.bias", "linear_attn.dt_bias"),
                     ("ssm_conv1d", "linear_attn.conv1d"), ("ssm_norm", "linear_attn.norm"),
                     ("ssm_out", "linear_attn.out_proj"), ("post_attention_norm", "post_attention_layernorm"))),
    Architecture("qwen3_5_moe", "qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", driven=False, recurrent=True,
                 text_model="language_model", text_config="text_config"),
    # LFM2 GGUFs: llama.cpp's names for its blocks, and its conv kernels squeezed.
    Architecture("lfm2", "lfm2", "Lfm2ForCausalLM", driven=False, recurrent=True, gguf="lfm2",
                 gguf_conv="conv.conv.weight",
                 gguf_names=(("attn_norm", "operator_norm"), ("ffn_norm", "ffn_norm"), ("ffn_gate", "feed_forward.w1"),
                             ("ffn_down", "feed_forward.w2"), ("ffn_up", "feed_forward.w3"),
                             ("shortconv.conv", "conv.conv"), ("shortconv.in_proj", "conv.in_proj"),
                             ("shortconv.out_proj", "conv.out_proj"), ("attn_output", "self_attn.out_proj"),
                             ("attn_q_norm", "self_attn.q_layernorm"), ("attn_k_norm", "self_attn.k_layernorm"))),
    # Mamba 2 and Nemotron-H GGUFs: llama.cpp's names for the mixers (under "backbone", as
    # Hugging Face names them), its Mamba-2 layout, squeezed conv kernels, and Q/K rows
    # permuted as for llama (Nemotron-H's attention has no RoPE, so either order computes alike).
    Architecture("mamba2", "mamba2", "Mamba2ForCausalLM", driven=False, recurrent=True, gguf="mamba2",
                 gguf_names=_MAMBA2_GGUF, gguf_layers="backbone.layers", gguf_conv="mixer.conv1d.weight",
                 gguf_mamba2=True),
    Architecture("nemotron_h", "nemotron_h", "NemotronHForCausalLM", driven=False, recurrent=True,
                 gguf="nemotron_h",
                 gguf_names=_MAMBA2_GGUF + (("attn_q", "mixer.q_proj"), ("attn_k", "mixer.k_proj"),
                                            ("attn_v", "mixer.v_proj"), ("attn_output", "mixer.o_proj"),
                                            ("ffn_up", "mixer.up_proj"), ("ffn_down", "mixer.down_proj")),
                 gguf_layers="backbone.layers", gguf_conv="mixer.conv1d.weight", gguf_mamba2=True,
                 gguf_permuted=True),
    # Granite 4 hybrid GGUFs (dense): llama.cpp's Mamba-2 layout in "mamba" mixers, Q/K permuted.
    Architecture("granitemoehybrid", "granitemoehybrid", "GraniteMoeHybridForCausalLM", driven=False, recurrent=True,
                 gguf="granitehybrid", gguf_names=_mamba2_gguf("mamba"), gguf_conv="mamba.conv1d.weight",
                 gguf_mamba2=True, gguf_permuted=True),
    *(Architecture(model_type, model_type, hf_class, driven=False, recurrent=True) for model_type, hf_class in (
        ("qwen3_next", "Qwen3NextForCausalLM"), ("falcon_h1", "FalconH1ForCausalLM"),
        ("lfm2_moe", "Lfm2MoeForCausalLM"),
        ("jamba", "JambaForCausalLM"), ("kimi_linear", "KimiLinearForCausalLM"))),
)}

SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)  # what loads and converts
DRIVEN_MODEL_TYPES = tuple(t for t, a in ARCHITECTURES.items() if a.driven and a.text_model is None)
GGUF_ARCHITECTURES: Dict[str, Architecture] = {a.gguf: a for a in ARCHITECTURES.values() if a.gguf}
# The hybrid and recurrent models, as the decoder sees them: the text model of a multimodal
# wrapper is mlx-lm's "<wrapper>_text".
HYBRID_MODEL_TYPES = tuple(name for t, a in ARCHITECTURES.items() if a.recurrent
                           for name in ((t, f"{t}_text") if a.text_model else (t,)))


def architecture(model_type: Optional[str]) -> Architecture:
    """The record for ``model_type``, or one line naming the supported ones."""
    if model_type not in ARCHITECTURES:
        raise UserError(f"model type {model_type!r} is not supported; supported are {', '.join(SUPPORTED_MODEL_TYPES)}")
    return ARCHITECTURES[model_type]


# What identifies a target for a shipped head: its architecture, not the name of the
# directory it was loaded from (a converted GGUF, a Hugging Face folder and a Hub snapshot
# of the same model are all named differently).
IDENTITY_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                 "num_key_value_heads", "vocab_size", "rope_theta", "tie_word_embeddings")
def target_identity(model) -> Dict[str, object]:
    """The keys of a target's config that say which model it is."""
    args = vars(model.args)
    return {key: args.get(key) for key in IDENTITY_KEYS}


def text_config(config: dict) -> dict:
    """The config of the text model a config.json describes: itself, or the part a
    multimodal wrapper nests (with the wrapper's vocabulary size where it gives one)."""
    record = ARCHITECTURES.get(config.get("model_type"))
    if record is None or record.text_config is None or not isinstance(config.get(record.text_config), dict):
        return config
    nested = dict(config[record.text_config])
    if "vocab_size" in config:
        nested["vocab_size"] = config["vocab_size"]
    return nested


def model_classes(model_type: str) -> Tuple[type, type]:
    """mlx-lm's (Model, ModelArgs) for a supported model type, from its public modules."""
    module = importlib.import_module(f"mlx_lm.models.{architecture(model_type).module}")
    return module.Model, module.ModelArgs
