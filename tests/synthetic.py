"""Tiny models written the way the real tools write them: Hugging Face directories
(config.json, safetensors, tokenizer) and GGUF files (as llama.cpp's converter does)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Dict

import gguf
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as QT
from mlx.utils import tree_flatten
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from mlx_eagle.architectures import model_classes

CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It was 2024 and 42 dogs barked.",
    "def add(a, b):\n    return a + b  # sum\n\nprint(add(1, 2))",
    "你好，世界！今天天气很好。", "Emoji time 🙂🚀 and numbers 1234567.",
    "Paris is the capital of France; Berlin is the capital of Germany.",
] * 40
# Qwen2's and Llama 3's pre-tokenizer splits, as their tokenizer.json files have them.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPLIT = QWEN2_SPLIT.replace(r"\p{N}|", r"\p{N}{1,3}|")
# Llama 3.1's RoPE scaling (its published values, with an original context small enough
# that a 32-wide head has frequencies in all three bands).
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

ARCHS = {
    # name: (config model_type, GGUF architecture, tokenizer kind, GGUF pre-tokenizer)
    "llama": ("llama", "llama", "bpe", "smollm"),
    "llama3": ("llama", "llama", "bpe", "llama-bpe"),  # Llama 3.1: rope_scaling llama3, rope_freqs in the GGUF
    "mistral": ("mistral", "llama", "spm", None),
    "qwen2": ("qwen2", "qwen2", "bpe", "qwen2"),
    "qwen3": ("qwen3", "qwen3", "bpe", "qwen2"),
    # Gemma 3's text model: sliding-window layers (all but every sixth), (1 + w) norms, normed
    # sublayer outputs, scaled embeddings; the values llama.cpp fixes for it (local RoPE base
    # 10,000, query scale 1/sqrt(head_dim)) so that its GGUF converts back to the same model.
    "gemma3": ("gemma3_text", "gemma3", "bpe", "qwen2"),  # the model is what is tested: a BPE vocabulary
}
GEMMA3 = {"num_hidden_layers": 6, "sliding_window": 8, "sliding_window_pattern": 6, "query_pre_attn_scalar": 16,
          "rope_local_base_freq": 10000.0, "rope_theta": 1e6}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _bpe_tokenizer(pre: str) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    if pre == "smollm":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT if pre == "llama-bpe" else QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    if pre == "llama-bpe":  # Llama 3's tokenizer.json: a word in the vocabulary is one token
        data = json.loads(tokenizer.to_str())
        data["model"]["ignore_merges"] = True
        tokenizer = Tokenizer.from_str(json.dumps(data))
    return tokenizer


def llama_cpp_rope_freqs(config: Dict) -> np.ndarray:
    """rope_freqs as llama.cpp's convert_hf_to_gguf writes it for rope_type llama3."""
    scaling, dims = config["rope_scaling"], config["head_dim"]
    old_context = scaling["original_max_position_embeddings"]
    low_wavelength = old_context / scaling["low_freq_factor"]
    high_wavelength = old_context / scaling["high_freq_factor"]
    factors = []
    for freq in 1.0 / config["rope_theta"] ** (np.arange(0, dims, 2) / dims):
        wavelength = 2 * np.pi / freq
        if wavelength < high_wavelength:
            factors.append(1.0)
        elif wavelength > low_wavelength:
            factors.append(scaling["factor"])
        else:
            smooth = (old_context / wavelength - scaling["low_freq_factor"]) / (
                scaling["high_freq_factor"] - scaling["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / scaling["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def _spm_model() -> bytes:
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=model, vocab_size=384, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, hard_vocab_limit=False,
        unk_id=0, bos_id=1, eos_id=2, minloglevel=2,
        normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
    )
    return model.getvalue()


def _config(model_type: str, vocab_size: int) -> Dict:
    config = {
        "model_type": model_type, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 256, "vocab_size": vocab_size,
        "tie_word_embeddings": model_type != "mistral", "torch_dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2,
    }
    return config


def _weights(config: Dict, seed: int) -> Dict[str, np.ndarray]:
    model_class, args_class = model_classes(config["model_type"])
    model = model_class(args_class.from_dict(config))
    rng = np.random.default_rng(seed)
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        if name.endswith("norm.weight"):
            weights[name] = (1 + 0.1 * rng.standard_normal(value.shape)).astype(np.float32)
        else:
            weights[name] = (0.08 * rng.standard_normal(value.shape)).astype(np.float32)
    return weights


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


# Gemma 3's norms, as llama.cpp names them (its ffn_norm is the norm before the MLP).
_GGUF_GEMMA3_NAMES = dict(_GGUF_LAYER_NAMES, post_attention_layernorm="post_attention_norm",
                          pre_feedforward_layernorm="ffn_norm", post_feedforward_layernorm="post_ffw_norm")


def gguf_name(name: str, gguf_arch: str = "llama") -> str:
    if name in _GGUF_NAMES:
        return _GGUF_NAMES[name]
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    names = _GGUF_GEMMA3_NAMES if gguf_arch == "gemma3" else _GGUF_LAYER_NAMES
    return f"blk.{layer}.{names[module]}.{kind}"


def add_bpe_tokenizer(writer, tokenizer: Tokenizer, pre: str) -> None:
    """A byte-level BPE tokenizer and the ChatML template in a GGUF's metadata, as llama.cpp writes them."""
    data = json.loads(tokenizer.to_str())
    vocab = data["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)


def write_model(root: Path, arch: str, qtype=QT.F32, seed: int = 0, with_tokenizer: bool = True) -> Dict[str, Path]:
    """Write the same tiny model twice: as a Hugging Face directory and as a GGUF file."""
    model_type, gguf_arch, kind, pre = ARCHS[arch]
    hf_dir, gguf_path = root / f"{arch}-hf", root / f"{arch}.gguf"
    hf_dir.mkdir(parents=True)
    if kind == "bpe":
        tokenizer = _bpe_tokenizer(pre)
        vocab_size = tokenizer.get_vocab_size()
        tokenizer.save(str(hf_dir / "tokenizer.json"))
        (hf_dir / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>",
            "eos_token": "<|im_end|>", "chat_template": CHATML,
        }))
    else:
        import sentencepiece as spm

        proto = _spm_model()
        (hf_dir / "tokenizer.model").write_bytes(proto)
        (hf_dir / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
        sp = spm.SentencePieceProcessor(model_proto=proto)
        vocab_size = sp.get_piece_size()
    config = target_config(arch, vocab_size)
    (hf_dir / "config.json").write_text(json.dumps(config))
    weights = _weights(config, seed)
    mx.save_safetensors(str(hf_dir / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()})
    if not with_tokenizer:
        for name in ("tokenizer.json", "tokenizer.model"):
            (hf_dir / name).unlink(missing_ok=True)

    writer = gguf.GGUFWriter(str(gguf_path), gguf_arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_vocab_size(vocab_size)
    if arch in ("qwen3", "llama3", "gemma3"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if arch == "gemma3":
        writer.add_sliding_window(config["sliding_window"])
    if arch == "llama3":
        writer.add_rope_dimension_count(config["head_dim"])
        writer.add_tensor("rope_freqs.weight", llama_cpp_rope_freqs(config))
    if with_tokenizer:
        if kind == "bpe":
            add_bpe_tokenizer(writer, tokenizer, pre)
        else:
            writer.add_tokenizer_model("llama")
            writer.add_token_list([sp.id_to_piece(i) for i in range(vocab_size)])
            writer.add_token_scores([sp.get_score(i) for i in range(vocab_size)])
            writer.add_token_types([
                2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1
                for i in range(vocab_size)
            ])
            writer.add_bos_token_id(1)
            writer.add_eos_token_id(2)
            writer.add_unk_token_id(0)
            writer.add_add_bos_token(True)
    for name, value in weights.items():
        if gguf_arch == "llama" and ".q_proj." in name:
            value = _llama_cpp_permute(value, config["num_attention_heads"])
        elif gguf_arch == "llama" and ".k_proj." in name:
            value = _llama_cpp_permute(value, config["num_key_value_heads"])
        if gguf_arch == "gemma3" and name.endswith("norm.weight"):
            value = value + 1  # llama.cpp's convert_hf_to_gguf stores Gemma's (1 + w) norm weights shifted
        if value.ndim == 2 and qtype != QT.F32:
            writer.add_tensor(gguf_name(name, gguf_arch), gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name, gguf_arch), value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"hf": hf_dir, "gguf": gguf_path}


# Mixture-of-experts targets, as their Hugging Face configs describe them (tiny sizes).
MOE_CONFIGS = {
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [3],
                  "moe_intermediate_size": 32, "norm_topk_prob": True},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    # gpt-oss: attention sinks, biases, sliding-window layers every other layer, YaRN RoPE.
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
                "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": 64}},
}


def moe_config(model_type: str, vocab_size: int = 384) -> Dict:
    config = dict(_config(model_type, vocab_size), **MOE_CONFIGS[model_type])
    config["tie_word_embeddings"] = False
    return config


def target_config(arch: str, vocab_size: int = 384) -> Dict:
    """The tiny config of an ARCHS or MOE_CONFIGS architecture, or MiMo's, GLM-4.5's,
    DeepSeek-V3's or GLM-4.7-Flash's."""
    if arch in MOE_CONFIGS:
        return moe_config(arch, vocab_size)
    if arch == "mimo":  # Qwen2's layers, and an MTP module (test_mtp); no GGUF of it is read
        return dict(target_config("qwen2", vocab_size), model_type="mimo", num_nextn_predict_layers=1,
                    tie_word_embeddings=False)
    if arch == "glm4_moe":  # GLM-4.5: per-head QK norms, partial RoPE, experts routed by a biased sigmoid gate
        return dict(_config("glm4_moe", vocab_size), moe_intermediate_size=32, n_shared_experts=1,
                    n_routed_experts=4, routed_scaling_factor=1.5, num_experts_per_tok=2, n_group=1, topk_group=1,
                    first_k_dense_replace=1, norm_topk_prob=True, rope_scaling=None, use_qk_norm=True,
                    attention_bias=False, partial_rotary_factor=0.5, tie_word_embeddings=False)
    if arch in ("deepseek_v3", "glm4_moe_lite"):  # GLM-4.5's experts, multi-head latent attention
        return dict(target_config("glm4_moe", vocab_size), model_type=arch, kv_lora_rank=16, q_lora_rank=32,
                    qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
    config = _config(ARCHS[arch][0], vocab_size)
    if arch == "qwen2":
        config.pop("head_dim")
    if arch == "llama3":
        config.update(head_dim=32, rope_scaling=LLAMA3_ROPE)
    if arch == "gemma3":
        config.update(GEMMA3)
    return config


def build_model(config: Dict, seed: int = 0):
    """The mlx-lm model a config describes, with random weights, in memory."""
    model_class, args_class = model_classes(config["model_type"])
    model = model_class(args_class.from_dict(config))
    model.load_weights([(k, mx.array(v)) for k, v in _weights(config, seed).items()])
    mx.eval(model.parameters())
    return model


# Hugging Face names of one expert's projections, per MoE architecture.
_HF_EXPERTS = {"qwen3_moe": ("mlp.experts.{e}.",
                             {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}),
               "mixtral": ("block_sparse_moe.experts.{e}.", {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"})}


def _moe_directory(directory: Path, model_type: str) -> Dict:
    """A model directory's tokenizer files and config.json for a tiny MoE; returns the config."""
    directory.mkdir(parents=True)
    tokenizer = _bpe_tokenizer("qwen2")
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "chat_template": CHATML}))
    config = moe_config(model_type, tokenizer.get_vocab_size())
    (directory / "config.json").write_text(json.dumps(config))
    return config


def write_moe_mlx(root: Path, model_type: str, seed: int = 0) -> Path:
    """A tiny MoE model as an mlx-lm directory (stacked experts), as mlx-community publishes them."""
    directory = root / f"{model_type}-mlx"
    config = _moe_directory(directory, model_type)
    weights = {k: mx.array(v) for k, v in _weights(config, seed).items()}
    mx.save_safetensors(str(directory / "model.safetensors"), weights)
    return directory


def write_moe_hf(root: Path, model_type: str, seed: int = 0) -> Path:
    """A tiny MoE model as a Hugging Face directory: one tensor per expert, as published."""
    directory = root / f"{model_type}-hf"
    config = _moe_directory(directory, model_type)
    prefix, names = _HF_EXPERTS[model_type]
    weights = {}
    for name, value in _weights(config, seed).items():
        stacked = next((part for part in names if f"switch_mlp.{part}." in name), None)
        if stacked is None:
            weights[name] = value
            continue
        layer = name.split(".switch_mlp.")[0].rsplit(".", 1)[0]
        for expert, matrix in enumerate(value):
            weights[f"{layer}.{prefix.format(e=expert)}{names[stacked]}.weight"] = matrix
    mx.save_safetensors(str(directory / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()})
    return directory
