"""Bad input to the converter: one line naming the problem, a non-zero exit, nothing left behind."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import synthetic


def run_convert(src: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlx_eagle.convert", str(src), str(out), "--quiet"],
                          capture_output=True, text=True, timeout=300)


def assert_clean_failure(result, out: Path, *words: str) -> None:
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line and not line.startswith("hint:")]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    assert not out.exists()
    if out.parent.is_dir():
        assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def test_truncated_gguf(smollm_gguf, tmp_path):
    truncated = tmp_path / "truncated.gguf"
    with open(smollm_gguf, "rb") as source:
        truncated.write_bytes(source.read(3_000_000))
    assert_clean_failure(run_convert(truncated, tmp_path / "out"), tmp_path / "out", "truncated")


def test_wrong_magic(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"PK\x03\x04 this is a zip, not a GGUF")
    assert_clean_failure(run_convert(bogus, tmp_path / "out"), tmp_path / "out", "not a GGUF file")


def test_unsupported_architecture(tmp_path):
    paths = synthetic.write_model(tmp_path, "qwen2")
    config = (paths["hf"] / "config.json").read_text().replace('"qwen2"', '"gemma2"')
    (paths["hf"] / "config.json").write_text(config)
    assert_clean_failure(run_convert(paths["hf"], tmp_path / "out"), tmp_path / "out", "gemma2", "not supported")


def test_unsupported_gguf_architecture(tmp_path):
    paths = synthetic.write_model(tmp_path, "qwen2")
    data = paths["gguf"].read_bytes().replace(b"qwen2", b"gpt2x", 1)
    patched = tmp_path / "gpt2x.gguf"
    patched.write_bytes(data)
    assert_clean_failure(run_convert(patched, tmp_path / "out"), tmp_path / "out", "gpt2x", "not supported")


@pytest.mark.parametrize("source", ["gguf", "hf"])
def test_missing_tokenizer(source, tmp_path):
    paths = synthetic.write_model(tmp_path, "llama", with_tokenizer=False)
    assert_clean_failure(run_convert(paths[source], tmp_path / "out"), tmp_path / "out", "tokenizer")


def test_unwritable_output(tmp_path):
    paths = synthetic.write_model(tmp_path, "llama")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    result = run_convert(paths["gguf"], blocker / "out")
    assert_clean_failure(result, blocker / "out", "cannot write")


def test_existing_output_is_left_alone(tmp_path):
    paths = synthetic.write_model(tmp_path, "llama")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = run_convert(paths["gguf"], out)
    assert result.returncode != 0 and "already exists" in result.stderr
    assert (out / "keep.txt").read_text() == "mine"


def test_failure_midway_leaves_nothing(tmp_path):
    """A conversion that dies after writing has started removes its staging directory."""
    from mlx_eagle.convert import writer

    paths = synthetic.write_model(tmp_path, "llama")

    def broken_tokenizer(staging):
        (staging / "half.json").write_text("{")
        raise KeyboardInterrupt

    config = {"model_type": "llama"}
    with pytest.raises(KeyboardInterrupt):
        writer.write_model_dir(tmp_path / "out", config, [], broken_tokenizer, writer.OutputFormat(), None)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in paths.values())


def test_sigterm_midway_leaves_nothing_and_a_killed_runs_leftovers_are_removed(smollm_gguf, tmp_path):
    """SIGTERM unwinds like Ctrl-C (the staging directory is removed); SIGKILL cannot, so
    the next run removes what a dead process left; the output is not private (0700)."""
    import os
    import signal
    import time

    out = tmp_path / "out"
    process = subprocess.Popen([sys.executable, "-m", "mlx_eagle.convert", str(smollm_gguf), str(out), "--quiet",
                                "--dtype", "float32"], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".out.*.partial")):
        assert time.monotonic() < deadline and process.poll() is None, "no staging directory appeared"
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=60)
    assert process.returncode != 0 and not out.exists()
    assert list(tmp_path.iterdir()) == []

    leftover = tmp_path / ".out.999999999.x1y2.partial"  # a process id no system hands out
    (leftover / "half").mkdir(parents=True)
    synthetic_model = synthetic.write_model(tmp_path / "src", "llama")
    result = run_convert(synthetic_model["gguf"], out)
    assert result.returncode == 0, result.stderr
    assert not leftover.exists()
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask


def test_a_full_disk_gets_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    import errno

    from mlx_eagle.convert import target, writer
    from mlx_eagle.errors import UserError

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer, "_save_shard", full)
    paths = synthetic.write_model(tmp_path, "llama")
    with pytest.raises(UserError, match="No space left on device"):
        target.convert_target(paths["gguf"], tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_a_moe_gguf_says_where_its_model_runs_instead(tmp_path, arch):
    import gguf

    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((4, 8, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_clean_failure(run_convert(path, tmp_path / "out"), tmp_path / "out", "mixture-of-experts", "--model")
