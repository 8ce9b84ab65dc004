"""Defects a reliability tour found, each kept found: sampling settings too small to
compute decode greedily (everywhere, as Sampling decides it), a closed engine refuses
work instead of hanging, and a reply suspended in the caller's own thread does not
deadlock reset()."""

import mlx.core as mx
import pytest

from mlx_eagle.verify import MIN_TEMPERATURE, Sampling
from plain import plain_tokens


@pytest.mark.parametrize("settings", [{"temp": 1e-39}, {"temp": 5e-324}, {"temp": 1.0, "top_p": 1e-300}])
def test_settings_too_small_to_compute_decode_greedily(settings):
    import hybrids
    from mlx_eagle.decoder import SpeculativeDecoder
    from mlx_eagle.drafters.lookup import LookupDrafter

    assert Sampling(**settings).greedy and not Sampling(temp=2 * MIN_TEMPERATURE).greedy
    model = hybrids.build("lfm2")
    prompt = [5, 17, 33, 5, 17]
    expected = plain_tokens(model, prompt, 20)
    decoder = SpeculativeDecoder(model, LookupDrafter(lambda k: 1.0), Sampling(**settings), seed=0)
    tokens = [decoder.prefill(prompt)]
    while len(tokens) < 20:
        tokens += decoder.round(20 - len(tokens)).tokens
    assert tokens[:20] == expected


@pytest.fixture
def session(tmp_path):
    import hybrids

    from mlx_eagle import load
    from mlx_eagle.engine import Engine
    from mlx_eagle.session import ChatSession

    model, tokenizer = load(str(hybrids.write_directory(tmp_path, "lfm2")))
    engine = Engine(loaded=(model, tokenizer, None), draft="lookup")
    yield ChatSession(engine=engine, max_tokens=8)
    engine.close()


def test_a_closed_engine_refuses_work_instead_of_hanging(session):
    session.engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        list(session.send("hello"))
    with pytest.raises(RuntimeError, match="closed"):
        session.engine.reset_cache()


def test_reset_while_a_reply_is_suspended_in_the_same_thread(session):
    replies = session.send("hello there")
    next(replies)  # the reply has begun and is suspended here, holding the session
    session.reset()  # returns: it does not wait for the suspended reply
    assert session.history == []
    list(replies)  # the rest stops within a round (it was cancelled), and joins no history
    assert session.history == []
    assert "".join(chunk.text for chunk in session.send("again")) is not None and len(session.history) == 2


def _gguf(tmp_path, body: bytes, tensors: int = 0, fields: int = 1):
    import struct

    path = tmp_path / "hostile.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, tensors, fields) + body)
    return path


def _huge_declarations():
    import struct

    key = struct.pack("<Q", 1) + b"x"
    return {
        "an array of 10**12 bytes": key + struct.pack("<IIQ", 9, 0, 10**12) + bytes(16),
        "a string of 10**15 bytes": key + struct.pack("<IQ", 8, 10**15) + bytes(16),
        "an array of 10**9 strings": key + struct.pack("<IIQ", 9, 8, 10**9) + bytes(16),
        "a key of 2**63 bytes": struct.pack("<Q", 2**63) + bytes(16),
        "arrays nested past any use": key + struct.pack("<IIQ", 9, 9, 1) * 8 + bytes(16),
        "a type no GGUF has": key + struct.pack("<I", 99) + bytes(16),
    }


@pytest.mark.parametrize("case", list(_huge_declarations()))
def test_a_gguf_declaring_more_than_it_holds_is_refused_before_reading(tmp_path, case):
    import resource

    from mlx_eagle.convert.gguf_weights import open_gguf
    from mlx_eagle.errors import UserError

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(UserError, match="damaged"):
        open_gguf(_gguf(tmp_path, _huge_declarations()[case]))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KB: no allocation spree


def test_a_gguf_declaring_ten_million_tensors_is_refused(tmp_path):
    from mlx_eagle.convert.gguf_weights import open_gguf
    from mlx_eagle.errors import UserError

    with pytest.raises(UserError, match="tensors"):
        open_gguf(_gguf(tmp_path, bytes(32), tensors=10**7, fields=0))


def test_the_commands_refuse_the_69_byte_gguf_in_one_line(tmp_path):
    import struct
    import subprocess
    import sys

    path = tmp_path / "a.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"x"
                     + struct.pack("<IIQ", 9, 0, 10**12) + bytes(16))
    commands = (["mlx_eagle.convert", str(path), str(tmp_path / "out")], ["mlx_eagle.generate", "--model", str(path)])
    for command in commands:
        result = subprocess.run([sys.executable, "-m", *command], capture_output=True, text=True, timeout=120,
                                env={**__import__("os").environ, "MLX_EAGLE_CACHE": str(tmp_path / "cache")})
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 1 and lines[-1].startswith("error: ") and "damaged" in lines[-1], result.stderr
        assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    """A random EAGLE-3 head for a tiny Qwen3 target, saved in the official layout."""
    from synthetic import build_model, target_config

    from mlx_eagle.heads import new_head, save_head

    model = build_model(target_config("qwen3"))
    path = tmp_path_factory.mktemp("head") / "eagle3"
    save_head(new_head(model, "eagle3", draft_vocab_size=64, seed=1), path)
    return model, path


BAD_HEAD_CONFIGS = {  # the nine of the tour, and their kin
    "num_attention_heads 0": {"num_attention_heads": 0},
    "intermediate_size -1": {"intermediate_size": -1},
    "taps a string": {"taps": "abc"},
    "hidden_size a string": {"hidden_size": "576"},
    "eps a string": {"rms_norm_eps": "1e-5"},
    "theta a string": {"rope_theta": "10000"},
    "quantization 5": {"quantization": 5},
    "3 bits in groups of 7": {"quantization": {"bits": 3, "group_size": 7}},
    "llama3 rope scaling without its fields": {"rope_scaling": {"type": "llama3"}},
    "heads that do not divide": {"num_key_value_heads": 3},
    "a flag that is a string": {"norm_before_fc": "yes"},
    "no vocabulary": {"vocab_size": None},
    "quantized weights, no quantization": "quantize",
    "EAGLE-3 weights called eagle1": {"family": "eagle1"},
}


@pytest.mark.parametrize("case", list(BAD_HEAD_CONFIGS))
def test_a_bad_head_config_gets_one_line_naming_the_field(head_dir, tmp_path, case):
    import json
    import shutil

    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from mlx_eagle.errors import UserError
    from mlx_eagle.heads import load_head

    model, source = head_dir
    path = tmp_path / "head"
    shutil.copytree(source, path)
    config = json.loads((path / "config.json").read_text())
    change = BAD_HEAD_CONFIGS[case]
    if change == "quantize":  # quantized weights with config.json left as it was
        head = load_head(source, model)
        nn.quantize(head, group_size=32, bits=4, class_predicate=lambda p, m: isinstance(m, nn.Linear))
        mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(head.parameters())))
        named = "quantization"
    else:
        config.update(change)
        (path / "config.json").write_text(json.dumps(config))
        named = next(iter(change)) if case != "EAGLE-3 weights called eagle1" else "eagle3"
    with pytest.raises(UserError) as error:
        load_head(path, model)
    message = str(error.value)
    assert "\n" not in message and len(message) < 400 and named in message, message


def test_a_read_only_cache_is_named_with_the_fix(tmp_path, capsys, monkeypatch):
    """A cache that cannot be written: the GGUF conversion says so naming MLX_EAGLE_CACHE, and
    the timing says once that it is kept for this run only (not "once" on every run)."""
    import os
    from synthetic import build_model, target_config

    from mlx_eagle.costs import verify_costs
    from mlx_eagle.errors import UserError
    from mlx_eagle.models import converted_gguf

    if os.geteuid() == 0:  # root writes anywhere: a file where the cache directory should be
        (tmp_path / "cache").write_text("")
    else:
        (tmp_path / "cache").mkdir(mode=0o500)
    monkeypatch.setenv("MLX_EAGLE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(UserError, match="not writable; set MLX_EAGLE_CACHE"):
        converted_gguf(gguf, progress=False)
    verify_costs(build_model(target_config("qwen3")))
    said = capsys.readouterr().err
    assert "for this run" in said and "MLX_EAGLE_CACHE" in said and "passes once" not in said


def test_a_directory_with_only_a_pytorch_bin_says_so(tmp_path):
    import json

    from mlx_eagle.errors import UserError
    from mlx_eagle.models import load_target
    from synthetic import target_config

    (tmp_path / "config.json").write_text(json.dumps(target_config("qwen3")))
    (tmp_path / "pytorch_model.bin").write_bytes(b"x" * 1000)
    with pytest.raises(UserError, match="no .safetensors weights .*PyTorch .bin"):
        load_target(str(tmp_path))


def test_the_chat_prompt_history_lives_in_the_cache_it_is_told(tmp_path, monkeypatch):
    from mlx_eagle.chat import history_file

    monkeypatch.setenv("MLX_EAGLE_CACHE", str(tmp_path))
    assert history_file() == tmp_path / "chat_history"


def test_progress_in_a_log_is_whole_lines():
    import io

    from mlx_eagle.progress import progress_bar

    log = io.StringIO()
    for _ in progress_bar(range(3), desc="converting", file=log):
        pass
    assert "\r" not in log.getvalue() and log.getvalue().splitlines()[-1].startswith("converting: 100%")
