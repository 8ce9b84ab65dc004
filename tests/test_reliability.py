"""Defects a reliability tour found, each kept found: sampling settings too small to
compute decode greedily (everywhere, as Sampling decides it), a closed engine refuses
work instead of hanging, and a reply suspended in the caller's own thread does not
deadlock reset()."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from mlx_eagle.verify import MIN_TEMPERATURE, Sampling


@pytest.mark.parametrize("settings", [{"temp": 1e-39}, {"temp": 5e-324}, {"temp": 1.0, "top_p": 1e-300}])
def test_settings_too_small_to_compute_decode_greedily(settings):
    import hybrids
    from mlx_eagle.decoder import SpeculativeDecoder
    from mlx_eagle.drafters.lookup import LookupDrafter

    assert Sampling(**settings).greedy and not Sampling(temp=2 * MIN_TEMPERATURE).greedy
    model = hybrids.build("lfm2")
    prompt = [5, 17, 33, 5, 17]
    expected = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=20)]
    decoder = SpeculativeDecoder(model, LookupDrafter(lambda k: 1.0), Sampling(**settings), seed=0)
    tokens = [decoder.prefill(prompt)]
    while len(tokens) < 20:
        tokens += decoder.round(20 - len(tokens)).tokens
    assert tokens[:20] == expected


@pytest.fixture
def session(tmp_path):
    import test_hybrid

    from mlx_eagle import load
    from mlx_eagle.session import ChatSession, Engine

    model, tokenizer = load(str(test_hybrid.write_directory(tmp_path, "lfm2")))
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
