"""Drafts from earlier replies (drafters/history.py): the index against a brute-force
reference, the continuation tree's counts, eviction, a persisted history that survives a
restart and refuses damage and other models, two processes writing one file, histories
kept apart per model id, and lossless decoding on the real model with the history on."""

import io
import json
import os
import stat
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from mlx_eagle.drafters.history import FORMAT, History
from mlx_eagle.errors import UserError
from mlx_eagle.drafters.lookup import continuation_tree
from commands import run_generate
from plain import plain_tokens

ROOT = Path(__file__).resolve().parent.parent


def brute_force(replies, context, max_match, depth):
    """Every occurrence of the context's last KEY tokens, the last OCCURRENCES kept, each
    followed back as far as it matches: the longest, and what followed each of them."""
    key = History.KEY
    occurrences = [(number, end) for number, reply in enumerate(replies) for end in range(key, len(reply))
                   if list(reply[end - key:end]) == list(context[-key:])][-History.OCCURRENCES:]
    best, found = 0, []
    for number, end in occurrences:
        reply, length = replies[number], key
        while length < max_match and length < len(context) and end - length - 1 >= 0 \
                and reply[end - length - 1] == context[-length - 1]:
            length += 1
        if length > best:
            best, found = length, [list(reply[end:end + depth])]
        elif length == best:
            found.append(list(reply[end:end + depth]))
    return best, found


@pytest.mark.parametrize("seed", range(6))
def test_matches_and_continuations_equal_a_brute_force_search(seed):
    rng = np.random.default_rng(seed)
    replies = [rng.integers(0, 4, size=rng.integers(4, 60)).tolist() for _ in range(30)]
    history = History()
    for reply in replies:
        history.add(reply)
    kept = [r for r in replies if len(r) > History.KEY]
    for _ in range(40):
        context = rng.integers(0, 4, size=rng.integers(3, 20)).tolist()
        best, found = history.match(context, 12, 5)
        expected_best, expected = brute_force(kept, context, 12, 5)
        assert best == expected_best and sorted(map(list, found)) == sorted(expected)


def test_the_tree_scores_continuations_by_their_counts():
    continuations = [[1, 2, 3]] * 6 + [[1, 2, 4]] * 2 + [[5, 6]] * 2
    tree, probabilities = continuation_tree(continuations, nodes=10, min_probability=0.1)
    paths = {}
    for node, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        paths[node] = (paths[parent] if parent >= 0 else ()) + (token,)
    found = dict(zip(paths.values(), probabilities))
    assert found == pytest.approx({(1,): 0.8, (1, 2): 0.8, (1, 2, 3): 0.6, (1, 2, 4): 0.2, (5,): 0.2, (5, 6): 0.2})
    assert probabilities == sorted(probabilities, reverse=True)  # best first, parents before children
    tree, probabilities = continuation_tree(continuations, nodes=10, min_probability=0.5)
    assert tree.tokens == [1, 2, 3]


def test_the_oldest_replies_go_first_past_the_cap():
    history = History(max_tokens=100)
    for number in range(30):
        history.add([number, 100, 101, 102, 103, 104, 105, 106, 107, number])
    assert history.held <= 100 and len(history) == 10
    assert history.match([100, 101, 102], 8, 2)[1][0].tolist() == [103, 104]
    # Evicted replies are dropped from the index once they outweigh the live ones.
    for number in range(8000):
        history.add([number % 97, number % 89, number % 83, 1, 2, 3, 4, 5, 6, 7])
    assert history.stale <= max(history.held, 1 << 16) and len(history.index) < 20000


def test_a_persisted_history_survives_a_restart_and_refuses_damage(tmp_path, capsys):
    path = tmp_path / "history.npz"
    history = History.open(path, "model-a", max_bytes=4096)
    for number in range(400):  # 11 KB of replies: the file keeps the newest under its 4 KiB cap
        history.add([7, 8, 9, 10, number % 5, 11, 12])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.stat().st_size < 4096 + 1024
    from mlx_eagle.drafters import history as module

    module._FILES.clear()  # a new process
    again = History.open(path, "model-a", max_bytes=4096)
    assert 50 < len(again) < 400 and again.match([7, 8, 9, 10], 8, 3)[0] == 4
    module._FILES.clear()
    assert len(History.open(path, "model-b", max_bytes=4096)) == 0
    assert "written for another model" in capsys.readouterr().err
    module._FILES.clear()
    with zipfile.ZipFile(path, "w") as archive:  # a history archive whose contents are damaged
        archive.writestr("header.npy", b"not an array")
    damaged = History.open(path, "model-a", max_bytes=4096)
    assert len(damaged) == 0 and "unusable" in capsys.readouterr().err
    damaged.add([1, 2, 3, 4, 5])
    module._FILES.clear()
    assert len(History.open(path, "model-a", max_bytes=4096)) == 1  # rebuilt
    # an archive whose entries claim to unpack to far more than the cap is not read
    module._FILES.clear()
    tokens = np.zeros(1 << 20, dtype=np.int32)  # 4 MiB of zeros: a few KiB deflated
    buffer = io.BytesIO()
    np.savez_compressed(buffer, header=np.frombuffer(json.dumps({"format": FORMAT, "identity": "model-a"}).encode(),
                                                     dtype=np.uint8),
                        tokens=tokens, lengths=np.array([len(tokens)], dtype=np.int32))
    path.write_bytes(buffer.getvalue())
    assert path.stat().st_size < 4096 + (1 << 20)
    assert len(History.open(path, "model-a", max_bytes=4096)) == 0
    assert "unpack to far more than its cap" in capsys.readouterr().err


def test_a_history_file_that_is_not_one_is_refused_never_replaced(tmp_path):
    """A typo must not destroy a user's file: a file that is not a history archive, a
    symbolic link (even to one), a directory, or a place that cannot be written is one line
    before anything is read or written, and the file is untouched."""
    notes = tmp_path / "notes.txt"
    notes.write_text("notes\n")
    link = tmp_path / "link.hist"
    link.symlink_to(notes)
    for path, says in [(notes, "not a history file"), (link, "symbolic link"), (tmp_path, "not a file")]:
        with pytest.raises(UserError, match=says):
            History.open(path, "model-a")
    assert notes.read_text() == "notes\n" and link.is_symlink()
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.geteuid() != 0:  # (root writes anywhere)
        with pytest.raises(UserError, match="cannot be written"):
            History.open(locked / "h.npz", "model-a")
    with pytest.raises(UserError, match="cannot be written"):
        History.open(notes / "h.npz", "model-a")  # under a file


WRITER = """
import sys
from mlx_eagle.drafters.history import History
history = History.open(sys.argv[1], "shared")
for number in range(20):
    history.add([int(sys.argv[2]), number, 1, 2, 3, 4])
"""


def test_two_processes_writing_one_file_lose_nothing(tmp_path):
    path = tmp_path / "history.npz"
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(w)], cwd=ROOT) for w in (100, 200)]
    assert [w.wait(timeout=120) for w in writers] == [0, 0]
    from mlx_eagle.drafters import history as module

    module._FILES.clear()
    merged = History.open(path, "shared")
    assert Counter(int(r[0]) for r in merged.replies.values()) == {100: 20, 200: 20}


def test_histories_are_kept_apart_per_model_id():
    import hybrids
    from mlx_eagle.engine import Engine

    model = hybrids.build("lfm2")
    engine = Engine(loaded=(model, _tokenizer_for(model), None), draft="lookup")
    try:
        list(engine.generate([5, 6, 7, 8, 9, 10], history_key="a", max_tokens=12))
        a, b = engine._call(lambda: (engine.plan(None, "a"), engine.plan(None, "b")))
        assert len(a.settings.history) == 1 and len(b.settings.history) == 0
        assert a.settings.history is not b.settings.history
    finally:
        engine.close()


def _tokenizer_for(model):
    """mlx-lm's tokenizer wrapper around a byte-level tokenizer of the model's vocabulary size."""
    import tempfile

    from mlx_lm.tokenizer_utils import load as load_tokenizer

    import synthetic

    directory = Path(tempfile.mkdtemp())
    synthetic._bpe_tokenizer("qwen2").save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                                  "eos_token": "<|im_end|>"}))
    return load_tokenizer(directory)


REPEATED = ("Extract the name and the city as JSON with keys name and city: "
            "'{who} moved to {city} last spring and likes it there.'")


def test_a_second_request_drafts_from_the_first_reply_and_keeps_the_text(smollm):
    from mlx_eagle import stream_generate
    from mlx_eagle.drafters.history import History

    model, tokenizer = smollm
    history = History()
    taus = []
    for who, city in (("Ana", "Lisbon"), ("Ben", "Oslo")):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": REPEATED.format(who=who, city=city)}],
                                            add_generation_prompt=True)
        expected = plain_tokens(model, ids, 40, tokenizer.eos_token_ids)
        responses = list(stream_generate(model, tokenizer, ids, max_tokens=40, draft="lookup", history=history))
        assert [r.token for r in responses] == expected[:len(responses)]
        taus.append(responses[-1].tokens_per_forward)
    assert len(history) == 2 and taus[1] > taus[0], taus


def test_the_command_keeps_its_history_in_the_file_it_is_given(smollm, tmp_path):
    path = tmp_path / "h.npz"

    def run(*args):
        return run_generate("--prompt", "Say hello in French.",
                               "--max-tokens", "12", *args)

    first = run("--history", str(path))
    assert first.returncode == 0, first.stderr[-2000:]
    assert path.exists() and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert run("--no-history").stdout == first.stdout
