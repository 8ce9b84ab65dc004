"""The architectures the tree path drives: one record per mlx-lm model type, holding
what target.py, the converters and the config checks need to know about it.

Adding an architecture is one record here (and its tests, tests/test_targets.py): the
mlx-lm module that builds it, the names its attention module gives its sizes, its
feed-forward block, its Hugging Face class and, where llama.cpp writes it, its GGUF
architecture. Every model mlx-lm loads drafts from the context without a record.
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
    experts: bool = False  # a mixture of experts: GGUF files of it are refused (other formats convert)


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
)}

SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)
GGUF_ARCHITECTURES: Dict[str, Architecture] = {a.gguf: a for a in ARCHITECTURES.values() if a.gguf}


def architecture(model_type: Optional[str]) -> Architecture:
    """The record for ``model_type``, or one line naming the supported ones."""
    if model_type not in ARCHITECTURES:
        raise UserError(f"model type {model_type!r} is not supported; supported are {', '.join(SUPPORTED_MODEL_TYPES)}")
    return ARCHITECTURES[model_type]


def model_classes(model_type: str) -> Tuple[type, type]:
    """mlx-lm's (Model, ModelArgs) for a supported model type, from its public modules."""
    module = importlib.import_module(f"mlx_lm.models.{architecture(model_type).module}")
    return module.Model, module.ModelArgs
