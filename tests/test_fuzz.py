"""Coverage by mutation: the readers of files a user downloads (GGUF, safetensors, config
files, PyTorch pickles, tree files) fed bytes derived from valid files, with bits
flipped, runs overwritten, cuts and splices, and random JSON for the config checks.
Each input must give either a result or one UserError: no other exception, and no
allocation past a bound. The budget (examples per reader) is fixed, so CI time is too;
set FUZZ_EXAMPLES to run longer."""

import json
import os
import resource
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from mlx_eagle.errors import UserError

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "400"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


@st.composite
def mutated(draw, original: bytes) -> bytes:
    """``original`` with a few edits: flipped bits, overwritten runs, a cut, a duplicated slice."""
    data = bytearray(original)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "overwrite", "cut", "splice"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "overwrite":
            run = draw(st.binary(min_size=1, max_size=8))
            data[at:at + len(run)] = run
        elif kind == "cut":
            del data[draw(st.integers(0, len(data))):]
        else:
            length = draw(st.integers(1, 64))
            data[at:at] = data[at:at + length]
    return bytes(data)


LIMIT_KB = 512 * 1024  # what one input may grow this process's peak memory by


def only_user_errors(read, data: bytes, path: Path):
    """``read`` the file holding ``data``: a result or a UserError, nothing else, and no
    input that makes it allocate without bound."""
    path.write_bytes(data)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        read(path)
    except UserError:
        pass
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown < LIMIT_KB, f"this input grew peak memory by {grown // 1024} MB"


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    """Small valid files of each kind, written by the tests."""
    import numpy as np
    import torch

    from synthetic import write_model

    root = tmp_path_factory.mktemp("fuzz")
    model = write_model(root, "llama")
    head = root / "head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"hidden_size": 64}))
    torch.save({"fc.weight": torch.from_numpy(np.arange(12, dtype=np.float32).reshape(3, 4)),
                "d2t": torch.arange(5)}, head / "pytorch_model.bin")
    import mlx.core as mx

    mx.save_safetensors(str(root / "weights.safetensors"), {"a": mx.arange(16).reshape(4, 4), "b": mx.ones(3)})
    return {"gguf": model["gguf"].read_bytes(), "bin": (head / "pytorch_model.bin").read_bytes(),
            "safetensors": (root / "weights.safetensors").read_bytes(),
            "config": (model["hf"] / "config.json").read_bytes(), "hf": model["hf"]}


def read_gguf(path: Path) -> None:
    """What mlx_eagle.convert reads of a GGUF before writing anything."""
    from mlx_eagle.convert import gguf_weights
    from mlx_eagle.convert.gguf_tokenizer import build_tokenizer

    reader = gguf_weights.open_gguf(path)
    config = gguf_weights.gguf_config(reader, path)
    build_tokenizer(reader, path, config["max_position_embeddings"])
    for tensor in gguf_weights.read_tensors(reader, config, path)[:3]:
        tensor.load()


def read_torch_bin(path: Path) -> None:
    from mlx_eagle.convert.torch_pickle import load_torch_bin

    load_torch_bin(path)


def read_head_safetensors(path: Path) -> None:
    """A head directory whose weights are the file at ``path``."""
    from mlx_eagle.heads import read_head_weights

    (path.parent / "config.json").write_text(json.dumps({"hidden_size": 64, "draft_vocab_size": 8}))
    read_head_weights(path.parent)


READERS = {  # sample: (the reader convert or load runs, the file name it reads)
    "gguf": (read_gguf, "model.gguf"),
    "bin": (read_torch_bin, "pytorch_model.bin"),
    "safetensors": (read_head_safetensors, "model.safetensors"),
}


@pytest.mark.parametrize("kind", READERS)
def test_a_reader_on_mutated_files(kind, samples, tmp_path):
    read, name = READERS[kind]

    @FUZZ
    @given(mutated(samples[kind]))
    def run(data):
        only_user_errors(read, data, tmp_path / name)

    run()


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)
CONFIG_KEYS = ["hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "vocab_size", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling"]


def test_the_config_checks(samples, tmp_path):
    from mlx_eagle.configs import check_model_config, read_config

    valid = json.loads(samples["config"])

    @FUZZ
    @given(st.dictionaries(st.sampled_from(CONFIG_KEYS), JSON, max_size=4), st.binary(max_size=40))
    def run(changes, raw):
        config = dict(valid, **changes)
        (tmp_path / "config.json").write_text(json.dumps(config))
        try:
            check_model_config(read_config(tmp_path, "a model directory"), "config.json", 10 ** 6)
        except UserError:
            pass
        only_user_errors(lambda path: read_config(path.parent, "a model directory"), raw, tmp_path / "config.json")

    run()


def test_the_tree_file_reader(tmp_path):
    from mlx_eagle.trees import read_tree_file

    @FUZZ
    @given(JSON)
    def run(paths):
        only_user_errors(lambda path: read_tree_file(str(path)), json.dumps(paths).encode(), tmp_path / "tree.json")

    run()


HEAD_KEYS = ["hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
             "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "taps", "draft_vocab_size", "quantization",
             "family", "bias", "norm_before_fc", "target_hidden_size", "max_position_embeddings"]


def test_the_head_config_checks(tmp_path):
    """Random values for a real head's config.json fields: the head loads, or one UserError."""
    from synthetic import build_model, target_config

    from mlx_eagle.heads import load_head, new_head, save_head

    model = build_model(target_config("qwen3"))
    save_head(new_head(model, "eagle3", draft_vocab_size=64, seed=1), tmp_path)
    valid = json.loads((tmp_path / "config.json").read_text())

    @settings(FUZZ, max_examples=max(EXAMPLES // 4, 20))
    @given(st.dictionaries(st.sampled_from(HEAD_KEYS), JSON, max_size=3))
    def run(changes):
        only_user_errors(lambda path: load_head(path.parent, model),
                         json.dumps(dict(valid, **changes)).encode(), tmp_path / "config.json")

    run()


@st.composite
def gguf_declaring(draw) -> bytes:
    """A GGUF header and metadata built from parts, each count and length drawn up to 2**64
    (not only mutations of a small valid file): arrays, strings, keys and tensor counts that
    claim far more than the file holds."""
    import struct

    huge = st.one_of(st.integers(0, 16), st.integers(0, 2 ** 64 - 1), st.sampled_from([2 ** 31, 2 ** 32, 10 ** 12]))
    fields = []
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.binary(max_size=6))
        kind = draw(st.integers(0, 13))
        field = struct.pack("<Q", draw(huge) if draw(st.booleans()) else len(key)) + key + struct.pack("<I", kind)
        if kind == 8:  # a string: its length
            field += struct.pack("<Q", draw(huge))
        elif kind == 9:  # an array: its item type and count
            field += struct.pack("<IQ", draw(st.integers(0, 13)), draw(huge))
        fields.append(field + draw(st.binary(max_size=16)))
    header = b"GGUF" + struct.pack("<IQQ", 3, draw(huge), draw(huge) if draw(st.booleans()) else len(fields))
    return header + b"".join(fields) + draw(st.binary(max_size=32))


def test_gguf_headers_declaring_huge_counts(tmp_path):
    @FUZZ
    @given(gguf_declaring())
    def run(data):
        only_user_errors(read_gguf, data, tmp_path / "model.gguf")

    run()


def test_the_cache_and_head_side_json_readers(tmp_path):
    """Random JSON as a calibration curve, an acceptance table and a tuned tree record
    (wrong types, missing keys, deep nesting, ranks of any size): each is read, or refused
    with a ValueError the caller turns into "timing again" / "ignored", nothing else."""
    from mlx_eagle.drafters.calibrate import _acceptance_table, _read_tree_record
    from mlx_eagle.costs import check_curve

    deep = {"verify_ms": {"1": [[[[[[1.0]]]]]]}, "paths": [[10 ** 12]], "acceptance_by_depth_and_rank": [[-1]]}

    @FUZZ
    @given(st.one_of(JSON, st.dictionaries(st.sampled_from(["verify_ms", "paths", "expected_tau", "why",
                                                             "acceptance_by_depth_and_rank", "device"]),
                                           JSON | st.just(deep["verify_ms"]) | st.just(deep["paths"]), max_size=4)))
    def run(record):
        (tmp_path / "record.json").write_text(json.dumps(record))
        for read in (check_curve, _acceptance_table, lambda r: _read_tree_record(tmp_path / "record.json")):
            try:
                read(record)
            except (ValueError, UserError):
                pass

    run()
