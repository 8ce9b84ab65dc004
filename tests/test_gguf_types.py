"""Every supported GGUF tensor type decodes to the values the gguf package (llama.cpp's
own Python reader) gives, and exact types stay exact as MLX quantization."""

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from mlx_eagle.convert.gguf_weights import NATIVE_BITS, REQUANTIZE_BITS, _source_tensor, native_quantized
from mlx_eagle.convert.writer import OutputFormat, convert_tensor

ROWS, COLS = 8, 512
# Byte offsets of the float16 scale fields inside one block of each K type.
_K_SCALE_FIELDS = {QT.Q2_K: (80, 82), QT.Q3_K: (108,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}


def _synthetic(qtype) -> np.ndarray:
    """Raw GGUF data for a ROWS x COLS tensor of this type."""
    rng = np.random.default_rng(int(qtype))
    values = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    if qtype == QT.F32:
        return values
    if qtype == QT.F16:
        return values.astype(np.float16)
    if qtype in _K_SCALE_FIELDS:  # gguf has no K quantizer: random blocks, sane scales
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, (ROWS * COLS // block_size, block_bytes), dtype=np.uint8)
        for offset in _K_SCALE_FIELDS[qtype]:
            scale = rng.uniform(0.001, 0.01, (blocks.shape[0], 1)).astype(np.float16)
            blocks[:, offset:offset + 2] = scale.view(np.uint8)
        return blocks.reshape(ROWS, -1)
    return gguf.quants.quantize(values, qtype)


ALL_TYPES = [QT.F32, QT.F16, QT.BF16, *NATIVE_BITS, *REQUANTIZE_BITS]


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantized_values_match_gguf_reference(qtype):
    data = _synthetic(qtype)
    reference = gguf.quants.dequantize(data, qtype).reshape(ROWS, COLS).astype(np.float32)
    tensor = _source_tensor("model.layers.0.mlp.up_proj.weight", data, qtype, (ROWS, COLS), None)
    value = convert_tensor(tensor, OutputFormat(dtype=mx.float32), mx.float32)
    np.testing.assert_array_equal(np.array(value), reference)


@pytest.mark.parametrize("qtype", list(NATIVE_BITS), ids=lambda t: t.name)
def test_exact_types_become_identical_mlx_quantization(qtype):
    data = _synthetic(qtype)
    reference = gguf.quants.dequantize(data, qtype).reshape(ROWS, COLS)
    native = native_quantized(data, qtype, ROWS, COLS)
    assert (native.bits, native.group_size) == (NATIVE_BITS[qtype], 32)
    value = mx.dequantize(native.weight, native.scales.astype(mx.float32), native.biases.astype(mx.float32),
                          group_size=32, bits=native.bits)
    np.testing.assert_array_equal(np.array(value.astype(mx.float32)), reference)
    # Asking for the same format keeps it; the kept form multiplies like the float one.
    tensor = _source_tensor("w.weight", data, qtype, (ROWS, COLS), None)
    kept = convert_tensor(tensor, OutputFormat(bits=NATIVE_BITS[qtype], group_size=32), mx.float32)
    assert mx.array_equal(kept.weight, native.weight)
    x = mx.random.normal((3, COLS), key=mx.random.key(0))
    product = mx.quantized_matmul(x, kept.weight, kept.scales, kept.biases, group_size=32, bits=kept.bits)
    assert mx.allclose(product, x @ mx.array(reference).T, atol=1e-4)


@pytest.mark.parametrize("qtype", list(REQUANTIZE_BITS), ids=lambda t: t.name)
def test_k_quants_are_requantized_close(qtype):
    data = _synthetic(qtype)
    reference = gguf.quants.dequantize(data, qtype).reshape(ROWS, COLS)
    tensor = _source_tensor("w.weight", data, qtype, (ROWS, COLS), None)
    value = convert_tensor(tensor, OutputFormat(), mx.float16)
    assert value.bits == REQUANTIZE_BITS[qtype]
    restored = np.array(mx.dequantize(value.weight, value.scales, value.biases, group_size=32, bits=value.bits))
    spread = reference.max() - reference.min()
    assert np.abs(restored - reference).max() <= spread / (2 ** value.bits - 1)


def test_row_permutation_applies_to_packed_rows():
    data = _synthetic(QT.Q4_1)
    order = np.random.default_rng(0).permutation(ROWS)
    tensor = _source_tensor("w.weight", data, QT.Q4_1, (ROWS, COLS), order)
    native = tensor.load_native()
    value = mx.dequantize(native.weight, native.scales.astype(mx.float32), native.biases.astype(mx.float32),
                          group_size=32, bits=4)
    reference = gguf.quants.dequantize(data, QT.Q4_1).reshape(ROWS, COLS)[order]
    np.testing.assert_array_equal(np.array(value.astype(mx.float32)), reference)


@pytest.mark.parametrize("qtype", [QT.IQ4_NL, QT.IQ2_XS], ids=lambda t: t.name)
def test_i_quants_are_refused_with_one_line(qtype):
    from types import SimpleNamespace

    from mlx_eagle.convert.gguf_weights import read_tensors
    from mlx_eagle.errors import UserError

    tensor = SimpleNamespace(name="blk.0.attn_q.weight", tensor_type=qtype, shape=np.array([COLS, ROWS]),
                             data=np.zeros(16, np.uint8))
    with pytest.raises(UserError, match=f"type {qtype.name}, which is not supported"):
        read_tensors(SimpleNamespace(tensors=[tensor]), {"model_type": "qwen2"}, "model.gguf")
