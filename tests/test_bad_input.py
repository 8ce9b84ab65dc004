"""The bad-input corpus: for each entry point (generate, the chat app, the server, the
target and head converters, training), inputs a user or an attacker could hand it,
each answered with one line naming the problem (or a 4xx JSON body), a non-zero exit,
nothing left behind, and no unbounded allocation. The server's HTTP cases are in
test_server.py, the converters' file-format cases in test_convert_errors.py; the
fuzzers are in test_fuzz.py."""

import importlib
import io
import json
import shutil
import signal
import socket
import sys
from pathlib import Path

import pytest

from mlx_eagle.cli import run_cli


def run_command(main, argv, capsys, monkeypatch, stdin: bytes = b""):
    """A command run as its console script runs it; returns (exit code, stderr lines)."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as exited:
            run_cli(main, argv)
    finally:
        signal.signal(signal.SIGTERM, previous)
    lines = [line for line in capsys.readouterr().err.splitlines()
             if line.strip() and not line.startswith("hint:") and "%|" not in line]  # progress bars aside
    return exited.value.code, lines


def assert_one_line(code, lines, *words):
    assert code == 1, lines
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for word in words:
        assert word in lines[0], lines[0]


@pytest.fixture(scope="module")
def bad_trees(tmp_path_factory):
    """Tree files that must each be refused in one line."""
    root = tmp_path_factory.mktemp("bad-trees")
    files = {"dir": root / "a-directory", "list": root / "list.json", "nulls": root / "nulls.json",
             "deep": root / "deep.json", "huge": root / "huge.json", "text": root / "text.json",
             "zero": Path("/dev/zero"), "bad_schema": root / "bad-schema.json"}
    files["dir"].mkdir()
    files["list"].write_text("[1, 2]")
    files["nulls"].write_text("[[null]]")
    files["deep"].write_text("[" * 100_000 + "]" * 100_000)
    files["huge"].write_text(json.dumps([[i] for i in range(5000)]))
    files["text"].write_text("not a tree")
    files["bad_schema"].write_text('{"type": "object", "properties": {"a": {"type": "strng"}}}')
    return {name: str(path) for name, path in files.items()}


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory, smollm_float32):
    """Model directories whose weights were cut short, or whose config asks for a million layers."""
    root = tmp_path_factory.mktemp("bad-models")
    for name in ("truncated", "million-layers"):
        shutil.copytree(smollm_float32, root / name)
    weights = root / "truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100_000])
    config = json.loads((root / "million-layers" / "config.json").read_text())
    (root / "million-layers" / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=1_000_000)))
    return {name: str(root / name) for name in ("truncated", "million-layers")}


TREES = [("dir", "not a regular file"), ("list", "rank paths"), ("nulls", "rank paths"), ("deep", "nested too deeply"),
         ("huge", "at most 256"), ("text", "not JSON"), ("zero", "not a regular file")]
OPTIONS = [(["--seed", "-1"], "seed"), (["--temp", "nan"], "temp"), (["--temp", "-1"], "temp"),
           (["--top-p", "2"], "top_p"), (["--top-p", "0"], "top_p"), (["--max-tokens", "0"], "max_tokens"),
           (["--max-tokens", "-5"], "max_tokens"), (["--tree", "chain:100"], "chain"),
           (["--tree", "dynamic:depth=0"], "depth"), (["--tree", "dynamic:size=3"], "size")]
KV_OPTIONS = [(["--kv-bits", "7"], "kv_bits"), (["--kv-bits", "4", "--kv-group-size", "48"], "kv_group_size"),
              (["--kv-bits", "8", "--quantized-kv-start", "-1"], "quantized_kv_start"),
              (["--quantized-kv-start", "100"], "without kv_bits"),
              (["--history", "{text}"], "not a history file"), (["--history", "{dir}"], "not a file")]
OPTIONS += KV_OPTIONS
GENERATE_ONLY = [(["--min-p", "2"], "min_p"), (["--top-k", "-3"], "top_k"),
                 (["--json-schema", "{dir}"], "not a regular file"), (["--json-schema", "{text}"], "not JSON"),
                 (["--json-schema", "{list}"], "JSON schema object"),
                 (["--json-schema", "{bad_schema}"], "cannot be followed"),
                 (["--json-schema", "/no/such/schema.json"], "does not exist")]


def forbid_loading(monkeypatch, module, name):
    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(module, name, loaded)


TREE_FILES = [(["--tree", f"static:{{{name}}}"], words) for name, words in TREES]


@pytest.mark.parametrize("argv, words", OPTIONS + GENERATE_ONLY + TREE_FILES)
def test_generate_refuses_bad_arguments_before_loading(argv, words, bad_trees, capsys, monkeypatch):
    import mlx_eagle.plan

    generate = importlib.import_module("mlx_eagle.generate.__main__")  # the command
    forbid_loading(monkeypatch, mlx_eagle.plan, "load")
    argv = [a.format(**bad_trees) for a in argv]
    assert_one_line(*run_command(generate.main, argv, capsys, monkeypatch), words)


@pytest.mark.parametrize("argv, stdin, words", [
    (["--prompt", "-"], b"\xff\xfe\x00 binary junk", "not UTF-8"),
    (["--prompt", "caf\udce9"], b"", "lone surrogate"),
    (["--model", "{truncated}"], b"", "damaged"),
    (["--model", "{million-layers}"], b"", "num_hidden_layers"),
    (["--model", "/dev/null"], b"", "neither a GGUF file nor a model directory"),
])
@pytest.mark.slow  # loads the real model, or converts it for the damaged copies
def test_generate_refuses_bad_input(argv, stdin, words, bad_models, capsys, monkeypatch):
    generate = importlib.import_module("mlx_eagle.generate.__main__")
    argv = [a.format(**bad_models) for a in argv]
    assert_one_line(*run_command(generate.main, argv + ["--max-tokens", "4"], capsys, monkeypatch, stdin), words)


@pytest.mark.parametrize("argv, words", OPTIONS + TREE_FILES[:3])
def test_chat_app_refuses_bad_arguments_before_loading(argv, words, bad_trees, capsys, monkeypatch):
    import mlx_eagle.session
    from mlx_eagle import chat

    forbid_loading(monkeypatch, mlx_eagle.session, "ChatSession")
    argv = [a.format(**bad_trees) for a in argv]
    assert_one_line(*run_command(chat.main, argv, capsys, monkeypatch), words)


@pytest.mark.parametrize("argv, words", [
    (["--port", "99999"], "not a port"), (["--port", "-2"], "not a port"), (["--max-tokens", "0"], "max_tokens"),
    (["--tree", "static:{dir}"], "not a regular file"), (["--host", "no.such.host.invalid"], "cannot listen"),
    (["--port", "{busy}"], "cannot listen"),
] + KV_OPTIONS)
def test_server_refuses_bad_arguments_before_loading(argv, words, bad_trees, capsys, monkeypatch):
    import mlx_eagle.engine
    from mlx_eagle.server import __main__ as server

    forbid_loading(monkeypatch, mlx_eagle.engine, "Engine")  # the server imports it when it loads
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        names = dict(bad_trees, busy=str(busy.getsockname()[1]))
        argv = [a.format(**names) for a in argv]
        assert_one_line(*run_command(server.main, argv, capsys, monkeypatch), words)


@pytest.mark.parametrize("change, words", [
    (lambda c: [c], "JSON list"),
    (lambda c: dict(c, hidden_size=None), "hidden_size"),
    (lambda c: {k: v for k, v in c.items() if k != "hidden_size"}, "hidden_size"),
    (lambda c: {k: v for k, v in c.items() if k != "num_hidden_layers"}, "num_hidden_layers"),
    (lambda c: {k: v for k, v in c.items() if k != "vocab_size"}, "vocab_size"),
    (lambda c: dict(c, hidden_size="64"), "hidden_size"),
    (lambda c: dict(c, hidden_size=64.0), "hidden_size"),
    (lambda c: dict(c, hidden_size=[64]), "hidden_size"),
    (lambda c: dict(c, num_attention_heads=0), "num_attention_heads"),
    (lambda c: dict({k: v for k, v in c.items() if k != "head_dim"}, num_attention_heads=6), "multiple"),
    (lambda c: dict(c, num_key_value_heads=3), "evenly"),
    (lambda c: dict(c, hidden_size=10 ** 12), "hidden_size"),
    (lambda c: dict(c, num_hidden_layers=-1), "num_hidden_layers"),
    (lambda c: dict(c, num_hidden_layers=1000), "weights"),  # more than the files could carry
    (lambda c: dict(c, num_hidden_layers=1_000_000), "num_hidden_layers"),
    (lambda c: dict(c, rope_theta=float("nan")), "rope_theta"),
    (lambda c: dict(c, rope_scaling={"type": "warp-drive", "factor": 2.0}), "rope_scaling"),
])
def test_convert_target_refuses_impossible_configs(change, words, tmp_path, capsys, monkeypatch):
    from mlx_eagle.convert import target
    from synthetic import write_model

    source = write_model(tmp_path, "llama")["hf"]
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps(change(config)))
    out = tmp_path / "out"
    assert_one_line(*run_command(target.main, [str(source), str(out), "--quiet"], capsys, monkeypatch), words)
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


def test_convert_target_refuses_dev_null(tmp_path, capsys, monkeypatch):
    from mlx_eagle.convert import target

    code, lines = run_command(target.main, ["/dev/null", str(tmp_path / "out")], capsys, monkeypatch)
    assert_one_line(code, lines, "/dev/null")
    assert "config.json" not in lines[0] and not (tmp_path / "out").exists()


def test_a_head_pickle_that_repeats_its_storage_is_refused_before_allocating(tmp_path, capsys, monkeypatch):
    """torch.zeros(1).expand(50000, 50000): 1.6 KB on disk, 9.3 GiB if materialized."""
    import resource

    import torch

    from mlx_eagle.convert import head

    directory = tmp_path / "bomb"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"hidden_size": 64}))
    torch.save({"fc.weight": torch.zeros(1).expand(50000, 50000)}, directory / "pytorch_model.bin")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    argv = [str(directory), str(tmp_path / "out")]
    assert_one_line(*run_command(head.main, argv, capsys, monkeypatch), "repeats")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 1 << 20  # KiB: under 1 GiB grown
    assert not (tmp_path / "out").exists()


def write_head_dir(root: Path, name: str, config=None, weights: bytes = None) -> str:
    directory = root / name
    directory.mkdir()
    if config is not None:
        (directory / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if weights is not None:
        (directory / "model.safetensors").write_bytes(weights)
    return str(directory)


HEADS = [  # (what the source is, words in the line)
    ("missing", "does not exist"), ("file", "is a file"), ("no-config", "config.json"),
    ("bad-json", "not JSON"), ("list-config", "JSON list"), ("no-weights", "no weights"),
    ("truncated", "damaged or truncated"),
]


@pytest.mark.parametrize("source, words", HEADS)
def test_convert_head_refuses_bad_sources_before_loading_a_target(source, words, tmp_path, capsys, monkeypatch):
    import mlx_eagle.plan
    from mlx_eagle.convert import head

    forbid_loading(monkeypatch, mlx_eagle.plan, "open_target")
    (tmp_path / "file").write_text("x")
    paths = {"missing": str(tmp_path / "absent"), "file": str(tmp_path / "file"),
             "no-config": write_head_dir(tmp_path, "no-config"),
             "bad-json": write_head_dir(tmp_path, "bad-json", "{"),
             "list-config": write_head_dir(tmp_path, "list-config", [1]),
             "no-weights": write_head_dir(tmp_path, "no-weights", {"hidden_size": 64}),
             "truncated": write_head_dir(tmp_path, "truncated", {"hidden_size": 64}, b"\x10\x00\x00\x00\x00")}
    out = tmp_path / "out"
    assert_one_line(*run_command(head.main, [paths[source], str(out)], capsys, monkeypatch), words)
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


@pytest.mark.parametrize("argv, words", [
    (["--steps", "0"], "steps"), (["--lr", "nan"], "lr"), (["--lr", "0"], "lr"), (["--seq-len", "1"], "seq-len"),
    (["--tokens-per-batch", "-4"], "tokens-per-batch"), (["--clip", "-1"], "clip"),
    (["--draft-vocab", "0"], "draft-vocab"),
    (["--held-out", "-1"], "held-out"), (["--work", "{file}"], "cannot use"),
    (["--store-features", "{file}"], "to keep the target"), (["--mix-self", "0"], "mix-self"),
    (["--answers", "self", "--mix-self", "3"], "--answers sharegpt"),
    (["--feature-noise", "-0.1"], "feature-noise"), (["--family", "eagle1", "--mask-outside-draft"], "EAGLE-3"),
])
def test_train_refuses_bad_arguments_before_loading(argv, words, tmp_path, capsys, monkeypatch):
    import mlx_eagle.plan
    from mlx_eagle.train import __main__ as train

    forbid_loading(monkeypatch, mlx_eagle.plan, "load")
    (tmp_path / "a-file").write_text("x")
    argv = [a.format(file=tmp_path / "a-file") for a in argv]
    code, lines = run_command(train.main, ["--out", str(tmp_path / "head")] + argv, capsys, monkeypatch)
    assert_one_line(code, lines, words)
    assert not (tmp_path / "head").exists()
