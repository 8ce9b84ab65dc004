"""A target sharded over several ranks (mlx.launch, ring backend, on this machine's
loopback): every drafter commits plain decoding's tokens on every rank, the commands
print once, and a rank that dies or hangs ends them all with one line."""

import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm import stream_generate as mlx_lm_stream_generate

from mlx_eagle import load, stream_generate
from mlx_eagle.costs import calibration_file, verify_costs
from mlx_eagle.engine import STOP_SECONDS
from mlx_eagle.replies import chat_tokens
from mlx_eagle.heads import new_head, save_head
from mlx_eagle.target import layer_count, make_cache, tapped_forward
from synthetic import write_model
from checkpoints import write_dflash

pytestmark = pytest.mark.slow  # every test starts ranks (mlx.launch)
TESTS = Path(__file__).resolve().parent
LAUNCHER = Path(sys.executable).parent / "mlx.launch"
# The ranks import the tests' drafters (named module:Class) and whatever this process imports.
RANK_PATH = os.pathsep.join([str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])
PROMPT = "The quick brown fox jumps over the lazy dog. It was 2024 and 42 dogs barked."


def launch(ranks: int, *command: str, timeout: float = 300, input: str = "", **env: str
           ) -> subprocess.CompletedProcess:
    """``command`` under mlx.launch on ``ranks`` local ranks (ports drawn at random: xdist
    workers may launch at once), ``input`` its standard input (every rank's)."""
    port = str(random.randrange(20000, 60000, 16))
    return subprocess.run([str(LAUNCHER), "-n", str(ranks), "--backend", "ring", "--starting-port", port, "--",
                           *command], capture_output=True, text=True, timeout=timeout, input=input,
                          env={**os.environ, "PYTHONPATH": RANK_PATH, **env})


def plain_tokens(model_dir, prompt, max_tokens: int):
    model, tokenizer = mlx_lm_load(str(model_dir))
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    return [r.token for r in mlx_lm_stream_generate(model, tokenizer, ids, max_tokens=max_tokens)]


@pytest.fixture(scope="module")
def sharp_llama(tmp_path_factory):
    """A tiny llama (4 heads, 2 KV heads) whose projections are scaled up, so that its greedy
    text varies, a random EAGLE-3 head for it, and beside the head a random DFlash drafter."""
    root = tmp_path_factory.mktemp("sharded")
    model_dir = write_model(root, "llama")["hf"]
    weights = mx.load(str(model_dir / "model.safetensors"))
    mx.save_safetensors(str(model_dir / "model.safetensors"),
                        {k: v * 3 if k.endswith("proj.weight") else v for k, v in weights.items()})
    model, _ = mlx_lm_load(str(model_dir))
    save_head(new_head(model, "eagle3", seed=5), root / "head")
    write_dflash(root / "dflash", model, [0, 2], block=4)
    return model_dir, root / "head"


def ranks_results(out: Path, ranks: int, launched: subprocess.CompletedProcess):
    """Every rank's results (mlx.launch may exit 0 when a rank fails: its output says so)."""
    files = [out / f"rank{r}-of-{ranks}.json" for r in range(ranks)]
    assert all(f.exists() for f in files), launched.stderr[-3000:]
    return [json.loads(f.read_text()) for f in files]


def probabilities(model, context):
    """The target's next-token distribution after ``context`` at temperature 1 and top-k 3."""
    from mlx_eagle.verify import Sampling

    logits = model(mx.array([context]))[0, -1]
    return np.array(Sampling(temp=1.0, top_k=3).probabilities(logits)).astype(np.float64)


def test_every_drafter_commits_plain_decodings_tokens_and_sampling_is_exact_on_every_rank(sharp_llama, tmp_path):
    """Split by heads over 2 ranks, in one launch (a launch costs seconds):
    - plain decoding, lookup, a head's tree and chain, its auto tree where the ranks'
      caches hold other tuned trees, DFlash, a draft model, and a drafter proposing other
      trees on rank 1 than on rank 0 all give single-process plain decoding's tokens (and
      mlx-lm's own sharded generation's) on both ranks;
    - seeded samples at temperature 1 and top-k 3, the second token from a round drafting
      two tokens on rank 0 (the likeliest ones after the likeliest first token: accepted
      part of the time) and another on rank 1: every rank draws the same tokens, and they
      follow the target's exact joint distribution."""
    from sampling_checks import chi_square_ok

    model_dir, head = sharp_llama
    expected = plain_tokens(model_dir, PROMPT, 30)
    assert len(set(expected)) > 15  # a text that varies
    model, tokenizer = mlx_lm_load(str(model_dir))
    ids = tokenizer.encode(PROMPT)
    script = tmp_path / "script.json"
    script.write_text(json.dumps(ids + expected))
    first = probabilities(model, ids)
    tree = [int(t) for t in np.argsort(-probabilities(model, ids + [int(np.argmax(first))]))[:2]]
    drafts = ["none", "lookup", "rank_drafter:RankDrafter", f"{head}@static:default", f"{head}@chain:4",
              str(head),  # --tree auto, from a tuned tree that differs between the ranks' caches: rank 0's
              str(head.parent / "dflash"),
              str(model_dir)]  # the model as its own draft model, whole on every rank (drafting where its timing pays)
    samples = 200
    result = launch(2, sys.executable, str(TESTS / "sharded_worker.py"), str(model_dir), str(tmp_path), PROMPT, "30",
                    ",".join(drafts + [f"sampled:{samples}"]), MLX_EAGLE_TEST_SCRIPT=str(script),
                    MLX_EAGLE_TEST_TUNED=str(head), MLX_EAGLE_TEST_TREE=json.dumps(tree))
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = ranks_results(tmp_path, 2, result)
    for rank in ranks:
        assert rank["sharding"] == "split by heads over 2 ranks"
        assert rank["mlx_lm"] == expected
        for draft in drafts:
            assert rank[draft]["tokens"] == expected, draft
        assert rank["rank_drafter:RankDrafter"]["tau"] > 2  # rank 0's drafts, accepted part way

    sampled = [rank[f"sampled:{samples}"] for rank in ranks]
    assert sampled[0]["tokens"] == sampled[1]["tokens"]
    assert sampled[0]["accepted"] > samples // 10  # rank 0's drafts, accepted part of the time
    counts = np.zeros((len(first), len(first)))
    for t1, t2 in sampled[0]["tokens"]:
        counts[t1, t2] += 1
    joint = np.stack([p * probabilities(model, ids + [t]) if p > 0 else np.zeros_like(first)
                      for t, p in enumerate(first)])
    assert counts[joint == 0].sum() == 0 and chi_square_ok(counts, joint)


def test_a_pipelined_hybrid_and_an_moe_split_by_heads_commit_plain_decodings_tokens(tmp_path):
    """Qwen3-Next pipelined by layers over 2 ranks (each rank runs two of its four layers),
    through the API and the command, and DeepSeek-V3 split by heads: every drafter kind gives
    plain decoding's tokens on both ranks, the model's own MTP module among them; the states
    a drafter reads at its taps are the single process's, wherever their layers run."""
    from hybrids import write_directory
    from checkpoints import EXPERT_CONFIGS, mtp_tensors, new_module

    from mlx_eagle.convert.target import convert_target

    hybrid = write_directory(tmp_path, "qwen3_next")
    weights = mx.load(str(hybrid / "model.safetensors"))
    (hybrid / "model.safetensors.index.json").write_text(json.dumps(  # what mlx-lm's pipelining reads
        {"metadata": {}, "weight_map": {name: "model.safetensors" for name in weights}}))
    model, tokenizer = load(str(hybrid))
    mx.save_safetensors(str(hybrid / "mtp.safetensors"), mtp_tensors(new_module(model), model))
    save_head(new_head(model, "eagle3", seed=5), tmp_path / "head")
    moe = write_directory(tmp_path, "deepseek_v3", EXPERT_CONFIGS["deepseek_v3"])
    moe_model, _ = load(str(moe))
    mx.save_safetensors(str(moe / "model.safetensors"), dict(mx.load(str(moe / "model.safetensors")))
                        | mtp_tensors(new_module(moe_model), moe_model))
    moe = convert_target(moe, tmp_path / "deepseek-converted", progress=False)  # its MTP module in mtp.safetensors
    drafts = ["none", "lookup", "rank_drafter:RankDrafter", "auto"]  # auto: the model's MTP module
    for model_dir, pipelined, more in ((hybrid, True, [f"{tmp_path / 'head'}@chain:3", str(hybrid)]), (moe, False, [])):
        expected = plain_tokens(model_dir, PROMPT, 40)
        script = tmp_path / "script.json"
        script.write_text(json.dumps(tokenizer.encode(PROMPT) + expected))
        out = tmp_path / f"ranks-{model_dir.name}"
        out.mkdir()
        env = {"MLX_EAGLE_TEST_PIPELINE": "1"} if pipelined else {}
        result = launch(2, sys.executable, str(TESTS / "sharded_worker.py"), str(model_dir), str(out), PROMPT, "40",
                        ",".join(drafts + more), MLX_EAGLE_TEST_SCRIPT=str(script), **env)
        assert result.returncode == 0, result.stderr[-3000:]
        single, _ = load(str(model_dir))
        states = tapped_forward(single, mx.array([tokenizer.encode(PROMPT)]), make_cache(single),
                                range(layer_count(single))).features[0]
        for rank in ranks_results(out, 2, result):
            assert rank["sharding"] == ("pipelined" if pipelined else "split by heads") + " over 2 ranks"
            assert np.allclose(rank["states"], np.array(states), atol=1e-4)
            assert rank["mlx_lm"] == expected
            for draft in drafts + more:
                assert rank[draft]["tokens"] == expected, (model_dir.name, draft)
            assert rank["rank_drafter:RankDrafter"]["tau"] > 2
    prompt = "Tell me about foxes."
    result = launch(2, sys.executable, "-m", "mlx_eagle.generate", "--model", str(hybrid), "--pipeline", "--prompt",
                    prompt, "-m", "24", "--no-history", "--verbose", "--tree", "chain:3")  # (a tree: it drafts)
    assert result.returncode == 0, result.stderr[-3000:]
    ids = chat_tokens(tokenizer, [{"role": "user", "content": prompt}])
    assert result.stdout.strip() == tokenizer.decode([t for t in plain_tokens(hybrid, ids, 24)
                                                      if t not in tokenizer.eos_token_ids]).strip()
    assert result.stderr.count("model: pipelined over 2 ranks") == 1
    assert "drafts: the model's MTP module, tree chain:3" in result.stderr, result.stderr[-2000:]


def test_smollm2_split_three_ways_answers_as_plain_decoding_printed_once(smollm, smollm_float32):
    """The real SmolLM2 (9 heads, 3 KV heads) over 3 ranks, through the command as a user
    runs it, drafting with its shipped head's default tree and lookup: plain decoding's text,
    printed by rank 0 alone."""
    # Three ranks on two cores time their forward passes slowly (~2 minutes): the ranks start
    # from this process's timings instead, under the sharded model's name. (The greedy rechecks'
    # tolerance comes from them too: a mismatch it let through would fail the comparison.)
    model, tokenizer = smollm
    timed = calibration_file(model)
    verify_costs(model)
    shutil.copy(timed, timed.with_name(timed.name.replace("-float32-", "-float32-split-by-heads-over-3-ranks-")))
    prompt = "What is the capital of France? Answer in one sentence."
    result = launch(3, sys.executable, "-m", "mlx_eagle.generate", "--model", str(smollm_float32), "--prompt", prompt,
                    "-m", "24", "--tree", "static:default", "--no-history", "--verbose", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    ids = chat_tokens(tokenizer, [{"role": "user", "content": prompt}])
    expected = tokenizer.decode([t for t in plain_tokens(smollm_float32, ids, 24) if t not in tokenizer.eos_token_ids])
    assert result.stdout.strip() == expected.strip()
    assert result.stderr.count("model: split by heads over 3 ranks") == 1
    assert "drafted: eagle3 head, tree static:default:" in result.stderr and "timing this device" not in result.stderr


def test_a_model_that_cannot_be_split_or_differs_between_ranks_gets_one_line(sharp_llama, smollm_float32, tmp_path):
    result = launch(2, sys.executable, "-m", "mlx_eagle.generate", "--model", str(smollm_float32), "--prompt", "hi")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 or "exited with code 1" in result.stdout + result.stderr
    assert errors == [f"error: {smollm_float32} cannot be sharded: its 9 attention heads, 3 KV heads cannot be split "
                      "over 2 ranks; run 3 ranks"]
    model_dir, _ = sharp_llama
    other = tmp_path / "other"
    write_model(other, "llama", seed=1)
    (tmp_path / "model0").symlink_to(model_dir)
    (tmp_path / "model1").symlink_to(other / "llama-hf")
    result = launch(2, sys.executable, str(TESTS / "sharded_worker.py"), str(tmp_path / "model{rank}"), str(tmp_path),
                    PROMPT, "4", "none")
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in ranks_results(tmp_path, 2, result):
        assert rank["error"].startswith("rank 1's model in") and "copy the same model directory" in rank["error"]


@pytest.mark.parametrize("fault", ["exit", "hang"])
def test_a_rank_that_dies_or_hangs_ends_every_rank_with_one_line(sharp_llama, fault):
    model_dir, _ = sharp_llama
    result = launch(2, sys.executable, "-m", "mlx_eagle.generate", "--model", str(model_dir), "--prompt", PROMPT,
                    "-m", "60", "--draft", "rank_drafter:RankDrafter", "--no-history", timeout=90,
                    MLX_EAGLE_TEST_FAULT=fault, MLX_EAGLE_RANK_TIMEOUT="5")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert errors[0].endswith("every rank stops" if fault == "exit" else "every rank stops (MLX_EAGLE_RANK_TIMEOUT "
                              "sets the wait)")


def plain_reply(model_dir, messages, max_tokens: int) -> str:
    """Plain decoding's reply, detokenized as a reply streams (test_server.py's reference)."""
    model, tokenizer = load(str(model_dir))
    ids = chat_tokens(tokenizer, messages)
    return "".join(r.text for r in stream_generate(model, tokenizer, ids, max_tokens=max_tokens, draft="none"))


def ranks_running(launcher: int) -> list:
    """The processes mlx.launch (``launcher``, leading its own session) started that still run."""
    listed = subprocess.run(["ps", "-s", str(launcher), "-o", "pid=,stat="], capture_output=True, text=True).stdout
    return [pid for pid, stat in (line.split() for line in listed.splitlines())
            if int(pid) != launcher and not stat.startswith("Z")]


def test_the_server_on_rank_0_answers_as_plain_decoding(sharp_llama):
    """Rank 0 serves, rank 1 follows: whole and streamed replies (the second read from the
    prefix cache on both ranks), a client that leaves mid-reply, then Ctrl-C ends both.
    (Lookup drafts: a fresh head drafter cannot take over a copied cache slot yet.)"""
    import signal

    import openai

    model_dir, _ = sharp_llama
    port = str(random.randrange(20000, 60000, 16))
    # Started as a terminal's foreground job is, Ctrl-C not ignored: a shell that runs the suite
    # in the background (CI's, under nohup) has every process it starts ignore it, and a server
    # that inherits that rightly goes on serving. (A handled signal is default across exec.)
    ignored = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        process = subprocess.Popen([str(LAUNCHER), "-n", "2", "--backend", "ring", "--starting-port", port, "--",
                                    sys.executable, "-m", "mlx_eagle.server", "--model", str(model_dir), "--draft",
                                    "lookup", "--port", "0", "--quiet"],
                                   stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": RANK_PATH},
                                   start_new_session=True)
    finally:
        signal.signal(signal.SIGINT, ignored)
    try:
        for line in process.stderr:
            match = re.search(r"at http://127\.0\.0\.1:(\d+)/v1", line)
            if match:
                break
        assert match and "split by heads over 2 ranks" in line, line
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{match.group(1)}/v1", api_key="-", max_retries=0,
                               timeout=120)
        messages = [{"role": "user", "content": PROMPT}]
        expected = plain_reply(model_dir, messages, 30)
        reply = client.chat.completions.create(model="m", messages=messages, max_tokens=30, temperature=0)
        assert reply.choices[0].message.content == expected
        chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=30, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
        left = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Tell a long story."}],
                                              max_tokens=200, temperature=0, stream=True)
        next(iter(left))
        left.close()  # rank 0 stops handing it out; both ranks finish it together, and go on in step
        reply = client.chat.completions.create(model="m", messages=messages, max_tokens=30, temperature=0)
        assert reply.choices[0].message.content == expected
        # Ctrl-C reaches each rank at its own moment: rank 1 first, by far here. It goes on
        # following, past the seconds a closing engine waits, until rank 0 closes it (it
        # ended on its own before, and rank 0's next request found no one to pair with).
        (follower,) = [pid for pid in ranks_running(process.pid)
                       if "MLX_RANK=1" in Path(f"/proc/{pid}/environ").read_text().split("\0")]
        os.kill(int(follower), signal.SIGINT)
        time.sleep(STOP_SECONDS + 2)
        reply = client.chat.completions.create(model="m", messages=messages, max_tokens=30, temperature=0)
        assert reply.choices[0].message.content == expected
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C in the terminal mlx.launch runs in: every rank ends
        deadline = time.monotonic() + 60
        while ranks_running(process.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not ranks_running(process.pid), "a rank was still running a minute after Ctrl-C"
        # (mlx.launch itself, its ranks gone, once hung here: its main thread waiting for the thread
        # that should reap a rank, the rank's exit unreaped; the finally below ends it then.)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()


def test_chat_on_rank_0_answers_as_on_one_machine(sharp_llama):
    """The chat app on 2 ranks prints what it prints on one machine (whose replies are plain
    decoding's: test_chat_app.py), once."""
    model_dir, _ = sharp_llama
    command = [sys.executable, "-m", "mlx_eagle.chat", "--model", str(model_dir), "--no-stats", "--max-tokens", "24",
               "--no-history"]
    typed = f"{PROMPT}\n/quit\n"  # (mlx.launch passes no end of input on)
    alone = subprocess.run(command, capture_output=True, text=True, input=typed, timeout=120)
    result = launch(2, *command, input=typed)
    assert result.returncode == 0, result.stderr[-3000:]
    reply = alone.stdout.split(">>> ")[1]
    assert len(reply.strip()) > 5 and result.stdout.count(reply) == 1
    assert "(model split by heads over 2 ranks;" in result.stdout
