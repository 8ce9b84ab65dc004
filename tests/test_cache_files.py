"""Files beside a head and in the user's cache that are damaged, hostile or measured under
load are caught: a corrupt calibration is timed again with one warning, a corrupt tuned or
calibrated tree is ignored (or rebuilt) with one warning, tree ranks are bounded, and
nothing is ever written into a head's own directory."""

import json

import numpy as np
import pytest

import mlx_eagle.costs
from mlx_eagle.drafters.calibrate import auto_tree, save_acceptance, tree_file, tuned_tree_file
from mlx_eagle.costs import CALIBRATION_SIZES, calibration_file, device_key, verify_costs
from mlx_eagle.errors import UserError
from mlx_eagle.heads import load_head, new_head, save_head
from mlx_eagle.trees import check_paths
from synthetic import build_model, target_config

CORRUPT_CALIBRATIONS = {
    "no curve": {"verify_ms": {}},
    "not an object": {"1": 50},
    "all zeros": {"verify_ms": {"1": 0, "2": 0}},
    "a list": [1, 2, 3],
    "400-digit numbers": {"verify_ms": {"1": 10 ** 400, "2": 10 ** 400}},
    "measured under load": {"verify_ms": {"1": 112.0, "2": 286.0, "4": 300.0}},
}


@pytest.fixture(scope="module")
def model():
    return build_model(target_config("qwen3"))


@pytest.mark.parametrize("content", CORRUPT_CALIBRATIONS)
def test_a_corrupt_calibration_is_timed_again_with_one_warning(model, content, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLX_EAGLE_CACHE", str(tmp_path))
    monkeypatch.setattr(mlx_eagle.costs, "_CURVES", {})
    path = calibration_file(model)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(CORRUPT_CALIBRATIONS[content]))
    costs = verify_costs(model)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning")]
    assert len(warnings) == 1 and "timing again" in warnings[0]
    assert costs.at()(1) == 1.0 and costs.at()(32) >= costs.at()(2) >= 1.0
    assert set(json.loads(path.read_text())["verify_ms"]) == {str(k) for k in CALIBRATION_SIZES}  # rewritten


def test_a_calibration_nested_200000_deep_is_timed_again(model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLX_EAGLE_CACHE", str(tmp_path))
    monkeypatch.setattr(mlx_eagle.costs, "_CURVES", {})
    path = calibration_file(model)
    path.parent.mkdir(parents=True)
    path.write_text("[" * 200_000 + "]" * 200_000)
    assert verify_costs(model).at()(1) == 1.0
    assert "nested too deeply" in capsys.readouterr().err


def test_a_model_whose_costs_were_read_is_freed_once_dropped(tmp_path, monkeypatch):
    """The process keeps each model's curves, not the model: a server or program that loads
    one model after another holds one at a time."""
    import gc
    import weakref

    monkeypatch.setenv("MLX_EAGLE_CACHE", str(tmp_path))
    model = build_model(target_config("qwen3"))
    assert verify_costs(model).at()(1) == 1.0
    freed = weakref.ref(model)
    del model
    gc.collect()
    assert freed() is None


TUNED_TREES = {"not json": "{not json", "no expected tau": '{"paths": [[0]]}', "no paths": '{"paths": []}',
               "ranks past 63": '{"paths": [[9000]]}', "deep": "[" * 200_000 + "]" * 200_000}


@pytest.mark.parametrize("content", TUNED_TREES)
def test_a_tuned_tree_file_that_is_damaged_is_ignored_or_read_safely(model, content, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLX_EAGLE_CACHE", str(tmp_path / "cache"))
    save_head(new_head(model, "eagle3", draft_vocab_size=64), tmp_path / "head")
    head = load_head(tmp_path / "head", model)
    path = tree_file(tmp_path / "head", device_key(model))
    path.parent.mkdir()
    path.write_text(TUNED_TREES[content])
    spec, why = auto_tree(model, head)  # never a traceback
    if content == "no expected tau":
        assert spec.paths == [(0,)] and why.endswith(": 1 node")
    elif content == "no paths":
        assert spec.kind == "none" and "plain decoding is faster" in why
    else:
        assert "warning: ignoring the tuned tree" in capsys.readouterr().err


def test_a_tuned_tree_that_is_a_directory_is_ignored(model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLX_EAGLE_CACHE", str(tmp_path / "cache"))
    save_head(new_head(model, "eagle3", draft_vocab_size=64), tmp_path / "head")
    tree_file(tmp_path / "head", device_key(model)).mkdir(parents=True)
    auto_tree(model, load_head(tmp_path / "head", model))
    assert "not a regular file" in capsys.readouterr().err


def test_tree_ranks_are_bounded():
    with pytest.raises(UserError, match="from 0 to 63"):
        check_paths([[9000]], "test")
    with pytest.raises(UserError, match="from 0 to 63"):
        check_paths([[100_000_000_000]], "test")
    assert check_paths([[63]], "test") == [(63,)]


def test_a_tree_wider_than_the_heads_vocabulary_is_refused(model):
    from mlx_eagle.drafters.eagle import EagleDrafter
    from mlx_eagle.trees import TreeSpec

    head = new_head(model, "eagle3", draft_vocab_size=16)
    with pytest.raises(UserError, match="vocabulary of 16"):
        EagleDrafter(head, model, TreeSpec("static", [(0,), (40,)], text="wide"))


def test_acceptance_is_kept_in_the_users_cache_never_beside_the_head(model, tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_EAGLE_CACHE", str(tmp_path / "cache"))
    save_head(new_head(model, "eagle3", draft_vocab_size=64), tmp_path / "head")
    before = sorted(p.name for p in (tmp_path / "head").iterdir())
    head = load_head(tmp_path / "head", model)
    from mlx_eagle.drafters.calibrate import user_head_dir

    save_acceptance(user_head_dir(tmp_path / "head"), np.array([[0.9, 0.05]] * 4), "test")
    assert sorted(p.name for p in (tmp_path / "head").iterdir()) == before
    assert "acceptance recorded in acceptance.json" in auto_tree(model, head)[1]
    assert tuned_tree_file(tmp_path / "head", "x").is_relative_to(tmp_path / "cache")


@pytest.mark.parametrize("damage", [None, "missing", {"2": {"1": -5, "3": 9}}, [1, 2]])
def test_packed_passes_are_timed_once_when_first_priced_and_kept(model, damage, tmp_path, monkeypatch, capsys):
    """A calibration without them (or with them damaged) times packed passes of several
    rows when a batch's round first prices them, once, and keeps them beside the curve."""
    monkeypatch.setenv("MLX_EAGLE_CACHE", str(tmp_path))
    monkeypatch.setattr(mlx_eagle.costs, "_CURVES", {})
    costs = verify_costs(model)
    path = calibration_file(model)
    if damage is not None:
        record = json.loads(path.read_text())
        if damage == "missing":
            del record["packed_ms"]
        else:
            record["packed_ms"] = damage
        path.write_text(json.dumps(record))
        monkeypatch.setattr(mlx_eagle.costs, "_CURVES", {})
        costs = verify_costs(model)
    assert costs.packed_ms is None and costs.pass_ms(8, 8) == costs.verify(8)  # not yet: the one-row curve
    costs.measure_packed()
    kept = json.loads(path.read_text())["packed_ms"]
    assert set(kept) == {"2", "4", "8", "16"} and "timing this device's packed passes" in capsys.readouterr().err
    monkeypatch.setattr(mlx_eagle.costs, "_CURVES", {})
    again = verify_costs(model)
    assert again.packed_ms == costs.packed_ms and again.time_packed is None  # read back, not timed again
    assert again.pass_ms(16, 16) == pytest.approx(costs.packed_ms[16][1])
