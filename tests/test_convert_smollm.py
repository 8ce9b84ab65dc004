"""The real SmolLM2-135M-Instruct GGUF, converted as users convert it."""

import json

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import generate, load

from mlx_eagle.convert.gguf_weights import hf_name
from synthetic import _llama_cpp_permute


def _converted_as_gguf_layout(name: str, value: np.ndarray, config: dict) -> np.ndarray:
    """Re-apply llama.cpp's Q/K permutation so the converted tensor lines up with the file."""
    if ".q_proj." in name:
        return _llama_cpp_permute(value, config["num_attention_heads"])
    if ".k_proj." in name:
        return _llama_cpp_permute(value, config["num_key_value_heads"])
    return value


def _reference(tensor) -> np.ndarray:
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    return gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)


def test_float32_weights_equal_the_gguf_values(smollm_reader, smollm_float32):
    config = json.loads((smollm_float32 / "config.json").read_text())
    weights = mx.load(str(smollm_float32 / "model.safetensors"))
    assert len(weights) == len(smollm_reader.tensors)
    for tensor in smollm_reader.tensors:
        name = hf_name(tensor.name)
        value = np.array(weights[name])
        assert value.dtype == np.float32, name
        np.testing.assert_array_equal(_converted_as_gguf_layout(name, value, config), _reference(tensor), name)


def test_native_quantization_is_kept_bit_exact(smollm_reader, smollm_native):
    config = json.loads((smollm_native / "config.json").read_text())
    weights = mx.load(str(smollm_native / "model.safetensors"))
    bits = {"Q4_1": 4, "Q8_0": 8}
    for tensor in smollm_reader.tensors:
        name = hf_name(tensor.name)
        if tensor.tensor_type.name not in bits:
            continue
        path = name.rsplit(".", 1)[0]
        expected_bits = bits[tensor.tensor_type.name]
        packed = weights[f"{path}.weight"]
        assert packed.dtype == mx.uint32 and packed.shape[1] * 32 // expected_bits == _reference(tensor).shape[1]
        # In float32 the affine form reproduces the file's values exactly.
        scales, biases = (weights[f"{path}.{k}"].astype(mx.float32) for k in ("scales", "biases"))
        value = mx.dequantize(packed, scales, biases, group_size=32, bits=expected_bits)
        np.testing.assert_array_equal(
            _converted_as_gguf_layout(name, np.array(value.astype(mx.float32)), config), _reference(tensor), name
        )
    assert config["quantization"]["bits"] == 4
    assert config["quantization"]["model.embed_tokens"] == {"group_size": 32, "bits": 8}


def test_native_model_computes_like_the_float32_one(smollm_native, smollm_float32):
    native, tokenizer = load(str(smollm_native))
    native.set_dtype(mx.float32)  # float16 runs ~40x slower on a CPU
    dense, _ = load(str(smollm_float32))
    tokens = mx.array([tokenizer.encode("The capital of France is")])
    native_logits, dense_logits = native(tokens)[0, -1], dense(tokens)[0, -1]
    assert mx.argmax(native_logits).item() == mx.argmax(dense_logits).item()
    assert mx.allclose(native_logits, dense_logits, atol=2e-3, rtol=1e-3)


def test_chat_answer_names_paris(smollm_float32):
    model, tokenizer = load(str(smollm_float32))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    answer = generate(model, tokenizer, prompt, max_tokens=24)
    assert "Paris" in answer


TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog, doesn't it?",
    "code": "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\tprint({'a': [1, 2]})",
    "chinese": "机器学习是人工智能的一个分支。你好，世界！",
    "emoji": "Launch 🚀 in 3…2…1 👩‍💻🎉 café",
}


@pytest.mark.parametrize("kind", TEXTS)
def test_tokenizer_round_trips(kind, smollm_float32):
    _, tokenizer = load(str(smollm_float32))
    ids = tokenizer.encode(TEXTS[kind], add_special_tokens=False)
    assert tokenizer.decode(ids) == TEXTS[kind]


def test_tokenizer_matches_smollm2(smollm_float32):
    _, tokenizer = load(str(smollm_float32))
    # SmolLM2 splits digits one by one and keeps its ChatML markers whole.
    digits = tokenizer.encode("2024", add_special_tokens=False)
    assert [tokenizer.decode([i]) for i in digits] == ["2", "0", "2", "4"]
    assert tokenizer.encode("<|im_start|>user<|im_end|>", add_special_tokens=False)[::2] == [1, 2]
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_start|>", "<|im_end|>", 2)
    assert tokenizer.vocab_size == 49152


def test_chat_template_renders_chatml(smollm_float32):
    _, tokenizer = load(str(smollm_float32))
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Name a colour."},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n"
    )
    with_system = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], tokenize=False
    )
    assert with_system == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
