"""Tiny qwen2, qwen3, mistral and llama models, written by the tests both as Hugging Face
directories and as GGUF files, convert into mlx-lm directories that compute the same logits."""

import mlx.core as mx
import pytest
import sentencepiece as spm
from gguf import GGMLQuantizationType as QT
from mlx_lm import load

import synthetic
from mlx_eagle.convert.target import convert_target

TOKENS = mx.array([[5, 17, 33, 80, 120, 7, 250, 3]])
TEXTS = ["Hello world 2024!", "def f(x):\n  return x", "你好，世界", "🙂🚀 ok", "  two  spaces "]


@pytest.fixture(scope="module", params=list(synthetic.ARCHS))
def written(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    return request.param, root, synthetic.write_model(root, request.param)


def test_gguf_and_safetensors_give_the_same_model(written):
    arch, root, paths = written
    reference, reference_tokenizer = load(str(paths["hf"]))  # mlx-lm reads the HF directory itself
    expected = reference(TOKENS)
    for source in ("hf", "gguf"):
        model, tokenizer = load(str(convert_target(paths[source], root / f"from-{source}", progress=False)))
        assert mx.allclose(model(TOKENS), expected, atol=1e-5), source
        for text in TEXTS:
            ids = tokenizer.encode(text, add_special_tokens=False)
            assert tokenizer.decode(ids) == text, (source, text)


def test_gguf_tokenizer_equals_the_original(written):
    arch, root, paths = written
    _, tokenizer = load(str(convert_target(paths["gguf"], root / "tokenizer-check", progress=False)))
    if arch == "mistral":
        original = spm.SentencePieceProcessor(model_file=str(paths["hf"] / "tokenizer.model"))
        for text in TEXTS:
            assert tokenizer.encode(text) == [original.bos_id(), *original.encode(text)], text
    else:
        _, original = load(str(paths["hf"]))
        for text in TEXTS:
            assert tokenizer.encode(text) == original.encode(text), text
        assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
            "<|im_start|>user\nhi<|im_end|>\n"


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_quantized_gguf_keeps_its_quantization(arch, tmp_path):
    paths = synthetic.write_model(tmp_path, arch, qtype=QT.Q8_0)
    out = convert_target(paths["gguf"], tmp_path / "q8", progress=False)
    model, _ = load(str(out))
    assert model.layers[0].mlp.up_proj.bits == 8
    model.set_dtype(mx.float32)  # compare the weights' rounding, not float16 arithmetic
    reference, _ = load(str(paths["hf"]))
    # Q8_0 rounds the weights: close to the float model, not equal.
    assert mx.abs(model(TOKENS) - reference(TOKENS)).max().item() < 0.05


@pytest.mark.parametrize("options", [{"q_bits": 4, "q_group_size": 32}, {"dtype": "bfloat16"}])
def test_requested_format(options, tmp_path):
    paths = synthetic.write_model(tmp_path, "qwen3")
    model, _ = load(str(convert_target(paths["hf"], tmp_path / "out", progress=False, **options)))
    layer = model.layers[0].self_attn.q_proj
    if "q_bits" in options:
        assert (layer.bits, layer.group_size) == (4, 32)
    else:
        assert layer.weight.dtype == mx.bfloat16


def test_llama3_rope_scaling_is_rebuilt_from_rope_freqs(tmp_path):
    """A Llama 3.1 GGUF (rope_freqs, no rope_scaling in its metadata) converts to the
    config's own rope_scaling, and over 200 positions its logits are mlx-lm's on the
    Hugging Face directory; without the scaling they would not be."""
    import json

    paths = synthetic.write_model(tmp_path, "llama3")
    out = convert_target(paths["gguf"], tmp_path / "from-gguf", progress=False)
    assert json.loads((out / "config.json").read_text())["rope_scaling"] == synthetic.LLAMA3_ROPE
    tokens = mx.array([[(7 * i + 3) % 380 for i in range(200)]])
    expected = load(str(paths["hf"]))[0](tokens)
    assert mx.allclose(load(str(out))[0](tokens), expected, atol=1e-5)
    config = json.loads((paths["hf"] / "config.json").read_text())
    del config["rope_scaling"]
    (paths["hf"] / "config.json").write_text(json.dumps(config))
    assert not mx.allclose(load(str(paths["hf"]))[0](tokens), expected, atol=1e-3)


@pytest.mark.parametrize("divisors, message", [
    ([1.0, 3.0, 1.5, 8.0, 2.0, 8.0, 8.0, 8.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], "can rebuild"),
    ([1.0, 2.0, 8.0], "not 16 positive"),
    ([0.0] * 16, "not 16 positive"),
])
def test_rope_freqs_that_are_no_llama3_scaling_fail_with_one_line(divisors, message):
    import numpy as np

    from mlx_eagle.convert.gguf_weights import llama3_rope_scaling
    from mlx_eagle.errors import UserError

    with pytest.raises(UserError, match=message):
        llama3_rope_scaling(np.array(divisors), 10000.0, 32, None, "model.gguf")
