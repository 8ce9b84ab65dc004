"""Device-tuned trees: the builder finds the optimal tree for a known acceptance table
within its budget, weighs depth and size by their cost, --tree auto decodes plainly
when speculation is expected to lose, and on a device nobody tuned builds its tree from
the head's recorded acceptance and a few timed forwards, once."""

import itertools
import json

import mlx.core as mx
import numpy as np
import pytest

import mlx_eagle.drafters.calibrate
import mlx_eagle.costs
from mlx_eagle.drafters.calibrate import (CALIBRATED_MARGIN, PRIOR_ACCEPTANCE, auto_tree, best_tree, save_acceptance,
                                          tree_file)
from mlx_eagle.costs import Costs, device_key, non_decreasing
from mlx_eagle.heads import load_head, new_head, save_head
from mlx_eagle.train import measure_acceptance
from synthetic import write_model

TABLE = np.array([[0.8, 0.1, 0.05], [0.7, 0.1, 0.0], [0.6, 0.0, 0.0]])


def flat(ms=100.0, plain=100.0, step=0.0):
    return Costs({k: ms for k in (1, 2, 64)}, draft_step_ms=step, round_ms=0.0, plain_ms=plain)


def brute_force_tau(table, max_nodes):
    """The best expected tau over every tree of at most ``max_nodes`` nodes."""
    depths, ranks = table.shape
    nodes = [p for d in range(1, depths + 1) for p in itertools.product(range(ranks), repeat=d)]
    value = {p: float(np.prod([table[i][r] for i, r in enumerate(p)])) for p in nodes}
    best = 1.0
    for size in range(1, max_nodes + 1):
        for subset in itertools.combinations(nodes, size):
            chosen = set(subset)
            if all(len(p) == 1 or p[:-1] in chosen for p in subset):
                best = max(best, 1.0 + sum(value[p] for p in subset))
    return best


@pytest.mark.parametrize("max_nodes", [1, 3, 4])
def test_the_builder_finds_the_optimal_tree(max_nodes):
    choice = best_tree(TABLE, None, max_nodes)  # no costs: the most tau within the budget
    assert len(choice.paths) <= max_nodes
    assert choice.expected_tau == pytest.approx(brute_force_tau(TABLE, max_nodes))
    if max_nodes == 4:
        assert choice.paths == [(0,), (1,), (0, 0), (0, 0, 0)]
        assert choice.expected_tau == pytest.approx(1 + 0.8 + 0.1 + 0.56 + 0.336)


def test_the_budget_is_respected():
    table = np.full((8, 8), 0.9)
    for budget in (5, 16, 64):
        assert len(best_tree(table, flat(), budget).paths) == budget


def test_costs_shape_the_tree():
    # Free verification: the biggest tree that still gains; pricey draft steps: a shallow one.
    cheap = best_tree(TABLE, flat(), 64)
    assert cheap.expected_tau == pytest.approx(1 + sum(
        float(np.prod([TABLE[i][r] for i, r in enumerate(p)]))
        for d in (1, 2, 3) for p in itertools.product(range(3), repeat=d)))
    shallow = best_tree(TABLE, flat(step=40.0), 64)
    assert max(len(p) for p in shallow.paths) < 3


def test_expensive_verification_means_plain_decoding():
    # Verifying k tokens costs k times one (quantized weights on a CPU): nothing pays off.
    linear = Costs({k: 100.0 * k for k in (1, 2, 4, 8, 16, 32, 64)}, draft_step_ms=5.0, round_ms=2.0,
                   plain_ms=100.0)
    choice = best_tree(TABLE, linear, 64)
    assert choice.paths == [] and choice.expected_tokens_per_s == pytest.approx(10.0)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from mlx_eagle.convert.target import convert_target
    from mlx_eagle import load

    root = tmp_path_factory.mktemp("tiny-tune")
    model, _ = load(str(convert_target(write_model(root, "llama")["hf"], root / "mlx", progress=False)))
    return model, root


def test_auto_follows_the_tuned_file(tiny_target, tmp_path):
    model, _ = tiny_target
    head = new_head(model, "eagle3", draft_vocab_size=64)
    assert auto_tree(model, head)[1].startswith(f"calibrated for {device_key(model)}")  # untuned
    assert auto_tree(model, None)[0].kind == "none"
    head.directory = tmp_path
    path = tree_file(tmp_path, device_key(model))
    path.parent.mkdir()
    path.write_text(json.dumps({"paths": [], "plain_tokens_per_s": 12.0, "tree_tokens_per_s": 9.0}))
    spec, why = auto_tree(model, head)
    assert spec.kind == "none" and "plain decoding is faster" in why
    path.write_text(json.dumps({"paths": [[0], [0, 0], [1]], "expected_tau": 2.1}))
    spec, _ = auto_tree(model, head)
    assert spec.kind == "static" and spec.paths == [(0,), (1,), (0, 0)]


@pytest.mark.parametrize("setting", ["quantized", "float16", "reference BLAS"])
def test_auto_decodes_plainly_where_a_cpu_verifies_slowly(tiny_target, monkeypatch, setting):
    """Untuned, a CPU drafts only with float32 weights on a fast BLAS: otherwise a tree
    of k tokens costs about k plain steps, and auto says why and what to change."""
    import mlx.nn as nn

    model, _ = tiny_target
    if mx.default_device().type != mx.cpu:
        pytest.skip("the rule is for CPUs")
    head = new_head(model, "eagle3", draft_vocab_size=64)
    if mlx_eagle.costs.blas_in_use() != mlx_eagle.costs.REFERENCE_BLAS:  # float32 on a fast BLAS
        assert "calibrated for" in auto_tree(model, head)[1]
    embed, weight = model.model.embed_tokens, model.model.embed_tokens.weight
    if setting == "quantized":
        model.model.embed_tokens = nn.QuantizedEmbedding.from_embedding(embed, group_size=32, bits=4)
        expected = "quantized weights (convert with --dtype float32"
    elif setting == "float16":
        embed.weight = embed.weight.astype(mx.float16)
        expected = "float16 weights (convert with --dtype float32"
    else:
        monkeypatch.setattr(mlx_eagle.costs, "blas_in_use", lambda: mlx_eagle.costs.REFERENCE_BLAS)
        expected = "reference BLAS (install OpenBLAS"
    try:
        spec, why = auto_tree(model, head)
    finally:  # the model is shared with the other tests
        model.model.embed_tokens, embed.weight = embed, weight
    assert spec.kind == "none" and expected in why and "cannot pay off" in why


def test_measured_acceptance_is_a_probability_table(tiny_target):
    model, _ = tiny_target
    head = new_head(model, "eagle3", draft_vocab_size=model.args.vocab_size)
    rng = np.random.default_rng(0)
    from mlx_eagle.features import greedy_batch

    prompts = [rng.integers(3, model.args.vocab_size, size=n).tolist() for n in (5, 7)]
    pieces = [(tokens, np.arange(len(tokens)) >= len(prompt))
              for prompt, tokens in zip(prompts, greedy_batch(model, prompts, 12, []))]
    table = measure_acceptance(model, head, pieces, depths=3, ranks=4)
    assert table.shape == (3, 4) and (table >= 0).all() and (table.sum(1) <= 1 + 1e-6).all()
    # A head with its final norm zeroed scores every token alike: the target's token is
    # always its top draft, at every depth.
    head.norm.weight = mx.zeros_like(head.norm.weight)
    assert measure_acceptance(model, head, pieces, depths=3, ranks=4).tolist() == [[1.0, 0, 0, 0]] * 3


def test_timed_verification_costs_are_made_non_decreasing():
    assert non_decreasing([96, 127, 201, 159, 181, 208]) == pytest.approx([96, 127, 180, 180, 181, 208])
    assert non_decreasing([1, 2, 3]) == [1, 2, 3]
    assert non_decreasing([3, 2, 1]) == [2, 2, 2]


def test_measured_costs_cover_every_size_and_never_fall(tiny_target, real_timers):
    from mlx_eagle import load
    from mlx_eagle.tune import VERIFY_SIZES, measure_costs

    model, root = tiny_target
    _, tokenizer = load(str(root / "mlx"))
    costs = measure_costs(model, tokenizer, new_head(model, "eagle3", draft_vocab_size=64), context=32,
                          repeats=1, progress=False)
    timed = [costs.verify_ms[k] for k in VERIFY_SIZES]
    assert list(costs.verify_ms) == list(VERIFY_SIZES) and timed == sorted(timed) and timed[0] > 0
    assert costs.draft_step_ms > 0 and costs.plain_ms > 0 and costs.round_ms >= 0


def test_a_smaller_tree_is_timed_only_as_far_as_it_reaches():
    from mlx_eagle.tune import VERIFY_SIZES, verify_sizes

    assert verify_sizes(4) == (1, 2, 3, 4, 5) and verify_sizes(10) == (1, 2, 3, 4, 5, 6, 8, 10, 12)
    assert verify_sizes(64) == VERIFY_SIZES and verify_sizes(63) == VERIFY_SIZES


# Verification costs in ms for k = 1, 2, 4, ..., 64 tokens: as timed on this repository's
# 2-core CPU (SmolLM2, float32), and flat as on a GPU where one token costs what 64 do.
CPU_CURVE = {1: 53.5, 2: 58.6, 4: 70.2, 8: 81.8, 16: 121.5, 32: 176.6, 64: 290.0}
GPU_CURVE = {k: 20.0 + 0.05 * k for k in CPU_CURVE}


@pytest.mark.parametrize("curve", [CPU_CURVE, GPU_CURVE], ids=["cpu", "gpu"])
def test_the_cost_model_drafts_only_for_a_head_worth_it(curve):
    costs = Costs(curve, draft_step_ms=0.05 * curve[1], round_ms=0.0, plain_ms=curve[1])
    weak = np.full((5, 4), 0.02)
    strong = np.array([[0.8, 0.1, 0.05, 0.02]] * 5)
    assert best_tree(weak, costs, 64).paths == []
    choice = best_tree(strong, costs, 64)
    assert choice.paths and choice.expected_tokens_per_s > 1.5 * choice.plain_tokens_per_s
    # the prior for heads with nothing recorded drafts where verification is nearly free, not here
    prior = best_tree(PRIOR_ACCEPTANCE, costs, 64)
    assert (prior.expected_tokens_per_s >= CALIBRATED_MARGIN * prior.plain_tokens_per_s) == (curve is GPU_CURVE)


def test_calibration_is_cached_per_head_and_weight_format(tiny_target, tmp_path, monkeypatch):
    """Untuned: built once from the head's recorded acceptance and timed costs, then read
    from the cache; built again when the head changes or the weights do."""
    model, _ = tiny_target
    monkeypatch.setenv("MLX_EAGLE_CACHE", str(tmp_path / "cache"))
    timings = []
    original = mlx_eagle.drafters.calibrate.time_draft_step
    monkeypatch.setattr(mlx_eagle.drafters.calibrate, "time_draft_step", lambda *a: timings.append(1) or original(*a))
    save_head(new_head(model, "eagle3", draft_vocab_size=64), tmp_path / "head")
    save_acceptance(tmp_path / "head", np.array([[0.9, 0.05]] * 4), "test")
    head = load_head(tmp_path / "head", model)
    first, why = auto_tree(model, head)
    assert "acceptance recorded in acceptance.json" in why and len(timings) == 1
    assert auto_tree(model, head) == (first, why) and len(timings) == 1  # cached
    save_acceptance(tmp_path / "head", np.array([[0.01, 0.0]] * 4), "test, retrained")
    spec, why = auto_tree(model, load_head(tmp_path / "head", model))
    assert len(timings) == 2 and spec.kind == "none" and "no tree is expected" in why
    monkeypatch.setattr(mlx_eagle.costs, "cpu_blocker", lambda model: None)  # let a CPU time float16 too
    embed, weight = model.model.embed_tokens, model.model.embed_tokens.weight
    embed.weight = weight.astype(mx.float16)
    try:
        auto_tree(model, head)
    finally:  # the model is shared with the other tests
        embed.weight = weight
    assert len(timings) == 3


def test_an_unwritable_cache_only_means_timing_again(tiny_target, tmp_path, monkeypatch):
    from mlx_eagle.costs import verify_costs

    model, _ = tiny_target
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("MLX_EAGLE_CACHE", str(blocked))
    costs = verify_costs(model)
    assert costs.at()(1) == 1.0 and costs.at()(16) >= 1.0 and blocked.read_text() == "not a directory"


@pytest.mark.slow  # tunes the shipped head on the real model
def test_tune_never_writes_into_the_package(smollm, tmp_path, monkeypatch):
    """tune on the shipped head writes its tree and acceptance to the user's cache (or
    --out), and the package's own files stay byte for byte as shipped."""
    import hashlib
    import os
    import shutil
    from pathlib import Path

    import mlx_eagle
    from commands import run_command

    shipped = Path(mlx_eagle.__file__).parent / "weights"

    def digest():
        return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(shipped.rglob("*")) if p.is_file()}

    before = digest()
    # A cache of its own (a tuned tree there would change what --tree auto builds in other
    # tests), holding the session's converted model and timings: not converted or timed again.
    session, cache = Path(os.environ["MLX_EAGLE_CACHE"]), tmp_path / "cache"
    cache.mkdir()
    (cache / "models").symlink_to(session / "models")
    if (session / "calibration").exists():
        shutil.copytree(session / "calibration", cache / "calibration")
    monkeypatch.setenv("MLX_EAGLE_CACHE", str(cache))
    result = run_command("mlx_eagle.tune", "--prompts", "2", "--confirm", "1", "--max-tokens", "8", "--max-nodes", "4",
                         "--quiet")
    assert result.returncode == 0, result.stderr[-2000:]
    assert digest() == before
    written = list((tmp_path / "cache" / "heads").rglob("*.json"))
    assert {p.name for p in written} >= {"acceptance.json"} and any(p.parent.name == "trees" for p in written)
