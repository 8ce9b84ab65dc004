"""Training EAGLE heads: the loss falls, masks match a hand-built reference, the vocab
maps round-trip, a resumed run equals an uninterrupted one, padded batches see what each
sequence alone sees, the ShareGPT readers survive the truncated file and keep every turn."""

import json
from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_eagle.data import read_sharegpt, sharegpt_path, sharegpt_prompts, mtbench_questions
from mlx_eagle.heads import new_head
from mlx_eagle.errors import UserError
from mlx_eagle.train import StateStore, TrainConfig, Trainer, d2t_t2d, draft_vocabulary, epoch_batches, \
    drafter_to_train, make_batch, shift, target_states, ttt_unroll
from synthetic import write_model


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-train")


@pytest.fixture(scope="module")
def training_setup(tiny_root):
    """A sharpened training_setup llama, 12 repetitive sequences (answers after token 4), and a draft vocabulary."""
    from mlx_eagle.convert.target import convert_target
    from mlx_eagle import load

    root = tiny_root
    model, _ = load(str(convert_target(write_model(root, "llama")["hf"], root / "mlx", progress=False)))
    # Sharpen the random target (its LM head is the tied embedding): a near-uniform
    # target has nothing to learn, its cross-entropy floor is its entropy.
    model.model.embed_tokens.weight = model.model.embed_tokens.weight * 12
    rng = np.random.default_rng(0)
    # Repetitive sequences: a pattern a head can learn in a few steps; answers after token 4.
    pieces = []
    for _ in range(12):
        pattern = rng.integers(3, model.args.vocab_size, size=5)
        pieces.append((np.tile(pattern, 8).astype(np.int32), np.arange(40) >= 4))
    used = draft_vocabulary(pieces, model.args.vocab_size, 96)
    return model, pieces, used


def ttt_mask(length: int, step: int) -> mx.array:
    """The attention mask of unrolled step ``step`` over the keys of steps 0..step: position
    t sees step 0 up to t - step (the committed context) and, from each later step j, only
    its own ancestor at t - step + j, as a depth-``step`` tree node does at inference."""
    t = mx.arange(length)[:, None]
    s = mx.arange(length)[None]
    blocks = [s <= t - step] + [s == t - step + j for j in range(1, step + 1)]
    return mx.concatenate(blocks, axis=1)


def dense_ttt_unroll(head, target, tokens, features, steps):
    """Training-time test with the whole mask over every step's keys: the reference TTTCache
    must equal."""
    from mlx_lm.models.cache import KVCache

    next_tokens, cache, hidden = shift(tokens, -1), [KVCache()], head.project(features)
    for step in range(steps):
        mask = "causal" if step == 0 else ttt_mask(tokens.shape[1], step)
        out = head.step(target, hidden, next_tokens, cache, 0, mask)
        yield step, head.logits(target, out)
        hidden = shift(out, 1)


def test_ttt_mask_matches_a_hand_built_reference():
    # 4 positions, step 2: keys are [step 0 | step 1 | step 2], 4 each.
    expected = np.array([
        # step 0      step 1      step 2
        [0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0],  # t=0: no context yet, only itself
        [0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0],  # t=1: its parent at step 1 (position 0)
        [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0],  # t=2: context 0, parent at 1, itself
        [1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1],  # t=3: context 0..1, parent at 2, itself
    ], dtype=bool)
    assert np.array_equal(np.array(ttt_mask(4, 2)), expected)
    assert np.array_equal(np.array(ttt_mask(3, 1)), np.array([
        [0, 0, 0, 1, 0, 0], [1, 0, 0, 0, 1, 0], [1, 1, 0, 0, 0, 1]], dtype=bool))


@pytest.mark.parametrize("which", ["tiny", "SmolLM2"])
def test_ttt_attention_equals_the_dense_tree_mask(training_setup, smollm, which):
    """TTTCache scores L + k keys per query instead of (k + 1) L: the logits of every
    unrolled step, and the gradients through them, equal attention under the full mask."""
    model = training_setup[0] if which == "tiny" else smollm[0]
    head = drafter_to_train(model, TrainConfig(seed=3), np.arange(96))
    rng = np.random.default_rng(0)
    tokens = mx.array(rng.integers(3, 96, (2, 37)).astype(np.int32))
    features, _ = target_states(model, tokens, head.taps(model.args.num_hidden_layers))

    def total(unroll):
        def loss(head):
            return sum((logits * mx.cos(mx.arange(logits.size).reshape(logits.shape))).sum()
                       for _, logits in unroll(head, model, tokens, features, 4))
        return nn.value_and_grad(head, loss)(head)

    for (_, fast), (_, dense) in zip(ttt_unroll(head, model, tokens, features, 4),
                                     dense_ttt_unroll(head, model, tokens, features, 4)):
        assert mx.allclose(fast, dense, atol=2e-4, rtol=1e-4)
    (fast_loss, fast_grads), (dense_loss, dense_grads) = total(ttt_unroll), total(dense_ttt_unroll)
    assert abs(float(fast_loss) - float(dense_loss)) <= 1e-3 * abs(float(dense_loss))
    for (name, a), (_, b) in zip(tree_flatten(fast_grads), tree_flatten(dense_grads)):
        assert mx.allclose(a, b, atol=1e-3, rtol=1e-3), name


def test_d2t_t2d_round_trip():
    pieces = [(np.array([5, 5, 9, 9, 9, 2, 7]), np.arange(7) >= 1), (np.array([1, 9, 2]), np.arange(3) >= 1)]
    used = draft_vocabulary(pieces, vocab_size=12, size=3)
    assert list(used) == [2, 5, 9]
    d2t, t2d = d2t_t2d(used, 12)
    assert list(np.arange(3) + d2t) == [2, 5, 9]
    assert list(np.nonzero(t2d)[0]) == [2, 5, 9]


@pytest.mark.parametrize("family", ["eagle3", "eagle1"])
def test_a_few_steps_lower_the_loss(training_setup, tmp_path, family):
    model, pieces, used = training_setup
    config = TrainConfig(family=family, steps=30, tokens_per_batch=256, lr=3e-3, warmup=5, ttt_steps=3,
                         checkpoint_every=1000)
    losses = []
    for attempt in range(2):  # deterministic: two runs give the same losses
        head = drafter_to_train(model, replace(config, seed=1), used)
        work = tmp_path / f"run{attempt}"
        work.mkdir()
        Trainer(model, head, pieces, config, work, used=used, progress=False).run()
        losses.append([json.loads(line)["loss"] for line in (work / "log.jsonl").read_text().splitlines()])
    assert losses[0] == losses[1]
    assert np.mean(losses[0][-5:]) < 0.7 * np.mean(losses[0][:5])


def ten_step_trainer(training_setup, work, store=None, **levers):
    """The same 10-step run (checkpoints every 4 steps) wherever ``work`` is."""
    model, pieces, used = training_setup
    config = TrainConfig(steps=10, tokens_per_batch=128, grad_accum=2, lr=2e-3, warmup=3, ttt_steps=2,
                         checkpoint_every=4, **levers)
    head = drafter_to_train(model, replace(config, seed=2), used)
    return Trainer(model, head, pieces, config, work, used=used, progress=False, store=store)


LEVERS = {"feature_noise": 0.05, "mask_outside_draft": True, "train_embeddings": True}


@pytest.mark.parametrize("levers", [{}, LEVERS], ids=["plain", "every recipe lever"])
def test_resumed_run_reaches_the_same_weights(training_setup, tmp_path, levers):
    def trainer(work):
        return ten_step_trainer(training_setup, work, **levers)

    straight = trainer(tmp_path / "straight")
    straight.run()
    trainer(tmp_path / "stopped").run(stop_after=9)  # dies after step 9; its last checkpoint is step 8
    resumed = trainer(tmp_path / "stopped")
    assert resumed.step == 8
    resumed.run()
    for (name, a), (_, b) in zip(tree_flatten(straight.head.parameters()), tree_flatten(resumed.head.parameters())):
        assert mx.allclose(a, b, atol=1e-6), name


@pytest.mark.parametrize("lever", list(LEVERS))
def test_each_recipe_lever_changes_training_and_stays_deterministic(training_setup, tmp_path, lever):
    """Each lever of README's ablation table does something, the same thing twice."""
    from mlx_eagle.heads import load_head, save_head

    model, pieces, used = training_setup
    # This target's choices are all among the 96 draft tokens: half of them leaves some out.
    setup = (model, pieces, used[::2]) if lever == "mask_outside_draft" else training_setup
    runs = {}
    for name, levers in (("plain", {}), ("lever", {lever: LEVERS[lever]}), ("again", {lever: LEVERS[lever]})):
        trainer = ten_step_trainer(setup, tmp_path / name, **levers)
        trainer.run(stop_after=4)
        runs[name] = ([json.loads(line)["loss"] for line in (tmp_path / name / "log.jsonl").read_text().splitlines()],
                      trainer.head)
    assert runs["lever"][0] == runs["again"][0] and runs["lever"][0] != runs["plain"][0]
    if lever == "train_embeddings":
        head = runs["lever"][1]
        assert not mx.allclose(head.embed_tokens.weight, model.model.embed_tokens.weight.astype(mx.float32))
        save_head(head, tmp_path / "saved")
        assert "embed_tokens" in load_head(tmp_path / "saved", model)


def test_a_kill_in_the_middle_of_saving_a_checkpoint_loses_nothing(training_setup, tmp_path):
    """Killed between the save's two renames (only the retired checkpoint left) with a
    half-written staging directory beside it: the run resumes from the old one, reaches the
    same weights, and its log holds every step once."""
    from mlx_eagle.files import retired

    def trainer(work):
        return ten_step_trainer(training_setup, work)

    straight = trainer(tmp_path / "straight")
    straight.run()
    work = tmp_path / "killed"
    trainer(work).run(stop_after=9)  # its last checkpoint is step 8; steps 1..9 are logged
    (work / "checkpoint").replace(retired(work / "checkpoint"))
    staging = work / ".checkpoint.999999999.x.partial"  # a process that is gone
    staging.mkdir()
    (staging / "head.safetensors").write_bytes(b"half")
    with open(work / "log.jsonl", "a") as log:
        log.write('{"step": 10, "lo')  # a line cut by the kill
    resumed = trainer(work)
    assert resumed.step == 8
    resumed.run()
    for (name, a), (_, b) in zip(tree_flatten(straight.head.parameters()), tree_flatten(resumed.head.parameters())):
        assert mx.allclose(a, b, atol=1e-6), name
    steps = [json.loads(line)["step"] for line in (work / "log.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 11))
    assert sorted(p.name for p in work.iterdir() if "checkpoint" in p.name) == ["checkpoint"]


def test_sharegpt_reader_survives_the_truncated_file():
    count = sum(1 for _ in read_sharegpt(sharegpt_path()))
    assert count >= 17000
    prompts = sharegpt_prompts(limit=200)
    banned = {" ".join(t.lower().split()) for q in mtbench_questions() for t in q["turns"]}
    assert len(prompts) == 200 and not banned & {" ".join(p.lower().split()) for p in prompts}


def test_padded_batches_give_each_sequence_its_own_states(training_setup):
    """Rows of different lengths padded into one batch: every row's target states and
    counted positions are those of the sequence alone (padding is never seen or counted)."""
    model, pieces, _ = training_setup
    taps = new_head(model, "eagle3").taps(model.args.num_hidden_layers)
    short, long = (pieces[0][0][:9], pieces[0][1][:9]), pieces[1]
    batch = make_batch([short, long], rows=3, length=64)
    features, last = target_states(model, batch["tokens"], taps)
    for row, (tokens, answer) in enumerate([short, long]):
        alone_features, alone_last = target_states(model, mx.array(tokens)[None], taps)
        assert mx.allclose(features[row, :len(tokens)], alone_features[0], atol=1e-4)
        assert mx.allclose(last[row, :len(tokens)], alone_last[0], atol=1e-4)
        counted = np.array(batch["mask"][row])
        assert counted[:len(tokens) - 2].tolist() == answer[2:].tolist() and not counted[len(tokens) - 2:].any()
    assert not np.array(batch["mask"][2]).any()


def test_batches_are_packed_by_tokens_and_cover_the_epoch():
    lengths = [30, 500, 64, 65, 700, 10, 128, 900] * 8
    config = TrainConfig(tokens_per_batch=1024, pad_multiple=64)
    batches = epoch_batches(lengths, config, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        padded = -(-max(lengths[i] for i in batch) // 64) * 64
        assert len(batch) * padded <= max(1024, padded)
    assert epoch_batches(lengths, config, epoch=0) == batches != epoch_batches(lengths, config, epoch=1)


def test_every_turn_of_a_dialogue_is_an_answer_in_its_context(smollm):
    """Multi-turn ShareGPT: each reply is marked as an answer up to its end-of-turn token,
    in the chat template's own text; a dialogue too long for one piece is cut between turns."""
    from mlx_eagle.data import dialogue_tokens, sharegpt_dialogues

    _, tokenizer = smollm
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
                {"role": "user", "content": "Another one?"}, {"role": "assistant", "content": "Green."}]
    [(tokens, answer)] = dialogue_tokens(tokenizer, messages, 2048)
    assert tokens.tolist() == tokenizer.apply_chat_template(messages)
    assert tokenizer.decode(tokens[answer].tolist()) == "Blue.<|im_end|>Green.<|im_end|>"
    pieces = dialogue_tokens(tokenizer, messages, len(tokens) - 3)  # the second reply no longer fits
    assert len(pieces) == 2 and tokenizer.decode(pieces[1][0][pieces[1][1]].tolist()) == "Green.<|im_end|>"
    banned = {" ".join(t.lower().split()) for q in mtbench_questions() for t in q["turns"]}
    dialogues = []
    for dialogue in sharegpt_dialogues():
        dialogues.append(dialogue)
        if len(dialogues) == 300:
            break
    assert any(len(d) > 2 for d in dialogues)
    for dialogue in dialogues:
        assert [m["role"] for m in dialogue] == ["user", "assistant"] * (len(dialogue) // 2)
        assert not banned & {" ".join(m["content"].lower().split()) for m in dialogue if m["role"] == "user"}


def test_sharegpt_reader_on_a_cut_file(tmp_path):
    records = [{"id": str(i), "conversations": [{"from": "human", "value": f"question number {i} here"}]}
               for i in range(5)]
    text = json.dumps(records)
    (tmp_path / "cut.json").write_text(text[: len(text) - 30])
    assert [r["id"] for r in read_sharegpt(tmp_path / "cut.json")] == ["0", "1", "2", "3"]


@pytest.mark.slow  # two ranks (mlx.launch)
def test_data_parallel_with_two_processes(training_setup, tiny_root, tmp_path):
    """mlx.launch starts two ranks on this machine; they share batches, average
    gradients, end with the same weights, and learn."""
    import subprocess
    import sys
    from pathlib import Path

    model, pieces, used = training_setup
    model_dir = tiny_root / "mlx"
    np.savez(tmp_path / "pieces.npz", *[t for t, _ in pieces])
    np.save(tmp_path / "vocab.npy", used)
    launcher = Path(sys.executable).parent / "mlx.launch"
    worker = Path(__file__).parent / "distributed_worker.py"
    result = subprocess.run(
        [str(launcher), "-n", "2", "--backend", "ring", sys.executable, str(worker), str(model_dir),
         str(tmp_path / "pieces.npz"),
         str(tmp_path / "vocab.npy"), str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    ranks = [mx.load(str(tmp_path / f"rank{r}-of-2.safetensors")) for r in range(2)]
    assert all(mx.array_equal(ranks[0][k], ranks[1][k]) for k in ranks[0])
    losses = [json.loads(line)["loss"] for line in (tmp_path / "work0" / "log.jsonl").read_text().splitlines()]
    assert np.mean(losses[-5:]) < np.mean(losses[:5])


def test_stored_states_are_the_targets_and_train_as_recomputed_ones(training_setup, tmp_path):
    """--store-features: every piece's states on disk equal the target's for that piece
    alone (to float16's precision); a fill killed part-way resumes to the same store; a
    run reading them trains as one recomputing them; another data set is refused."""
    model, pieces, used = training_setup
    taps = drafter_to_train(model, TrainConfig(), used).taps(model.args.num_hidden_layers)
    # lengths differ
    pieces = [(tokens[: 13 + 2 * i], answer[: 13 + 2 * i]) for i, (tokens, answer) in enumerate(pieces)]
    store = StateStore(tmp_path / "store", model, pieces, taps, seq_len=1024)
    assert store.missing() and store.fill(tokens_per_batch=64, progress=False) > 0 and not store.missing()
    for i, (tokens, _) in enumerate(pieces):
        features, last = target_states(model, mx.array(tokens)[None], taps)
        stored_features, stored_last = store.batch([i], 1, len(tokens))
        assert mx.allclose(stored_features[0], features[0], rtol=2e-3, atol=2e-3)
        assert mx.allclose(stored_last[0], last[0], rtol=2e-3, atol=2e-3)
    complete = np.array(store.states)

    (tmp_path / "store" / "filled.json").write_text(json.dumps({"pieces": 5}))  # killed after 5 pieces
    store.states[:store.starts[7]] = 0  # the longest come first: pieces 7..11 were done, 0..6 not
    resumed = StateStore(tmp_path / "store", model, pieces, taps, seq_len=1024)
    assert resumed.missing() and resumed.fill(tokens_per_batch=64, progress=False) > 0
    # (packed into other batches than before, so equal to float16's precision, not bit for bit)
    assert np.allclose(np.array(resumed.states, dtype=np.float32), complete, rtol=2e-3, atol=2e-3)
    assert StateStore(tmp_path / "store", model, pieces, taps, seq_len=1024).fill(64, progress=False) == 0.0

    setup = (model, pieces, used)
    recomputed, stored = ten_step_trainer(setup, tmp_path / "recomputed"), ten_step_trainer(setup, tmp_path / "stored",
                                                                                            store=resumed)
    recomputed.run()
    stored.run()
    logs = [[json.loads(line)["loss"] for line in (tmp_path / name / "log.jsonl").read_text().splitlines()]
            for name in ("recomputed", "stored")]
    assert np.allclose(logs[0], logs[1], rtol=1e-2)
    with pytest.raises(UserError, match="states of other pieces"):
        StateStore(tmp_path / "store", model, pieces[1:], taps, seq_len=1024)


@pytest.mark.slow  # the real model, twice through the command line
def test_train_command_stores_the_states_once_and_reuses_them(tmp_path, capsys):
    """python -m mlx_eagle.train --store-features on real ShareGPT dialogues and SmolLM2:
    the first run computes the states and trains; a second run on the same pieces (another
    lever) reads them without computing any, and trains to a loadable head."""
    from mlx_eagle import load
    from mlx_eagle.heads import load_head
    from mlx_eagle.train.__main__ import main

    def train(name, *flags):
        main(["--out", str(tmp_path / name), "--data", str(tmp_path / "data"), "--prompts", "2", "--held-out", "0",
              "--seq-len", "256", "--tokens-per-batch", "512", "--steps", "2", "--ttt-steps", "2", "--skip-eval",
              "--store-features", str(tmp_path / "states"), "--quiet", *flags])
        return capsys.readouterr().out

    assert "target states:" in train("first")
    assert "target states:" not in train("second", "--feature-noise", "0.1")
    model, _ = load()
    assert load_head(tmp_path / "second", model).family == "eagle3"
    meta = json.loads((tmp_path / "states" / "meta.json").read_text())
    assert (tmp_path / "states" / "states.f16").stat().st_size == meta["tokens"] * sum(meta["widths"]) * 2


@pytest.fixture
def disk_of(monkeypatch):
    """A disk with ``n`` bytes left per file, as a full disk refuses writes: RLIMIT_FSIZE
    (with SIGXFSZ ignored, the write fails with EFBIG), restored afterwards."""
    import resource
    import signal

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    def limit(n):
        resource.setrlimit(resource.RLIMIT_FSIZE, (n, hard))
    yield limit
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    signal.signal(signal.SIGXFSZ, previous)


def test_a_full_disk_keeps_the_last_checkpoint_and_says_so_in_one_line(training_setup, tmp_path, disk_of):
    import resource

    from mlx_eagle.errors import UserError

    work = tmp_path / "work"
    trainer = ten_step_trainer(training_setup, work)
    trainer.run(stop_after=4)  # checkpoint at step 4
    saved = {p.name: p.read_bytes() for p in (work / "checkpoint").iterdir()}
    disk_of(64 << 10)
    with pytest.raises(UserError, match="failed .*previous one is kept"):
        trainer.run(stop_after=8)  # its checkpoint at step 8 does not fit
    disk_of(256)
    with pytest.raises(UserError, match="log.jsonl failed"):
        ten_step_trainer(training_setup, work)  # resuming rewrites the log: on the still-full disk, one line
    disk_of(resource.RLIM_INFINITY)
    assert {p.name: p.read_bytes() for p in (work / "checkpoint").iterdir()} == saved
    assert sorted(p.name for p in work.iterdir()) == ["checkpoint", "log.jsonl"]  # nothing half-written
    assert ten_step_trainer(training_setup, work).step == 4


def test_a_full_disk_never_leaves_a_truncated_vocabulary(tmp_path, disk_of):
    import resource

    from mlx_eagle.files import write_npz

    path = tmp_path / "vocab-self-8192.npz"
    write_npz(path, used=np.arange(10))
    disk_of(4096)
    with pytest.raises(OSError):
        write_npz(path, used=np.arange(100_000))
    disk_of(resource.RLIM_INFINITY)
    assert list(np.load(path)["used"]) == list(range(10)) and [p.name for p in tmp_path.iterdir()] == [path.name]


def dflash_trainer(training_setup, work, steps=10, lr=2e-3):
    """The same DFlash run (blocks of 4, checkpoints every 4 steps) wherever ``work`` is."""
    model, pieces, _ = training_setup
    config = TrainConfig(family="dflash", steps=steps, tokens_per_batch=128, grad_accum=2, lr=lr, warmup=3,
                         checkpoint_every=4, block_size=4, anchors=6, dflash_layers=1, mask_token=2)
    return Trainer(model, drafter_to_train(model, config), pieces, config, work, progress=False)


def test_a_dflash_drafter_learns_deterministically_and_a_resumed_run_reaches_the_same_weights(training_setup,
                                                                                              tmp_path):
    losses = []
    for attempt in range(2):
        dflash_trainer(training_setup, tmp_path / f"run{attempt}", steps=30, lr=3e-3).run()
        losses.append([json.loads(line)["loss"] for line in (tmp_path / f"run{attempt}" / "log.jsonl")
                       .read_text().splitlines()])
    assert losses[0] == losses[1]
    assert np.mean(losses[0][-5:]) < 0.7 * np.mean(losses[0][:5])
    straight = dflash_trainer(training_setup, tmp_path / "straight")
    straight.run()
    dflash_trainer(training_setup, tmp_path / "stopped").run(stop_after=9)  # its last checkpoint is step 8
    resumed = dflash_trainer(training_setup, tmp_path / "stopped")
    assert resumed.step == 8
    resumed.run()
    for (name, a), (_, b) in zip(tree_flatten(straight.head.parameters()), tree_flatten(resumed.head.parameters())):
        assert mx.allclose(a, b, atol=1e-6), name


def test_dflash_training_sees_each_block_as_drafting_does(training_setup):
    """All blocks of a sequence in one masked pass give each block the logits the drafter
    gives it while decoding, its context read from the cache."""
    from mlx_lm.models.cache import KVCache

    from mlx_eagle.dflash_model import new_dflash
    from mlx_eagle.target import lm_head
    from mlx_eagle.train.dflash import blocks_logits

    model, pieces, _ = training_setup
    drafter = new_dflash(model, layers=2, block_size=4, mask_token_id=2, seed=3)
    tokens = mx.array(pieces[0][0])
    features = target_states(model, tokens[None], drafter.taps(4))[0][0]
    starts = mx.array([5, 11, 20])
    together = blocks_logits(drafter, model, tokens, features, starts)
    for index, anchor in enumerate(starts.tolist()):
        cache = [KVCache() for _ in drafter.layers]
        drafter.read_context(features[:anchor], cache, 0)
        alone = lm_head(model, drafter.blocks_states(model, [(int(tokens[anchor]), cache, anchor)])[0][1:])
        assert mx.allclose(together[index], alone, atol=1e-4), anchor


def test_a_dspark_drafter_learns_and_trains_each_block_as_it_drafts(training_setup, tmp_path):
    """DSpark through the DFlash stages: the loss falls; each block position is trained as
    the drafter drafts it (the Markov bias from the token before, teacher-forced, and the
    confidence from the same features); what it writes loads."""
    from mlx_lm.models.cache import KVCache

    from mlx_eagle.train.dflash import blocks_states

    from mlx_eagle.dspark_model import load as load_dspark, save_dspark
    from mlx_eagle.target import lm_head

    model, pieces, _ = training_setup
    config = TrainConfig(family="dspark", steps=24, tokens_per_batch=128, grad_accum=2, lr=3e-3, warmup=3,
                         checkpoint_every=8, block_size=4, anchors=6, dflash_layers=1, mask_token=2, markov_rank=16)
    trainer = Trainer(model, drafter_to_train(model, config), pieces, config, tmp_path / "work", progress=False)
    trainer.run()
    log = [json.loads(line) for line in (tmp_path / "work" / "log.jsonl").read_text().splitlines()]
    assert np.mean([r["loss"] for r in log[-4:]]) < 0.8 * np.mean([r["loss"] for r in log[:4]])
    drafter = trainer.head
    tokens = mx.array(pieces[0][0])
    features = target_states(model, tokens[None], drafter.taps(4))[0][0]
    anchor = 9
    cache = [KVCache() for _ in drafter.layers]
    drafter.read_context(features[:anchor], cache, 0)
    drafted, confidences = (part[0] for part in drafter.draft_blocks(model, [(int(tokens[anchor]), cache, anchor)]))
    states = blocks_states(drafter, model, tokens, features, mx.array([anchor]))[0]
    previous = mx.concatenate([tokens[anchor:anchor + 1], drafted[:-1]])  # the drafts it chose, as labels
    bias, embedding, _ = drafter.markov_head.step(previous, states, None)
    assert (mx.argmax(lm_head(model, states) + bias, axis=-1) == drafted).all()
    assert mx.allclose(mx.sigmoid(drafter.confidence_logits(states, embedding)), confidences, atol=1e-4)
    reloaded = tmp_path / "dspark"
    save_dspark(drafter, reloaded)
    assert mx.array_equal(load_dspark(reloaded, model).markov_head.markov_w2.weight,
                          drafter.markov_head.markov_w2.weight)
