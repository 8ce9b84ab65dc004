"""Long prompts' caches kept on disk (prompt_store.py): a new process's caches (a restarted
server) continue from them and decode plain decoding's tokens; entries that newer ones
extend go, the bound holds, and damaged, half-written and other models' files are never
read as this model's."""

import os
import time

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache

from mlx_eagle import prompt_store
from mlx_eagle.decoder import SpeculativeDecoder
from mlx_eagle.drafters.lookup import LookupDrafter
from mlx_eagle.prompt_cache import PromptCaches
from mlx_eagle.prompt_store import PromptStore
from mlx_eagle.verify import Sampling
from checkpoints import tiny_target
from plain import plain, plain_tokens

# Entries from 256 new tokens here, not prompt_store.MIN_TOKENS: the same mechanism, on
# prompts 8 times shorter.
MIN_TOKENS = 256
LONG = MIN_TOKENS + 100


@pytest.fixture(autouse=True)
def fewer_tokens(monkeypatch):
    monkeypatch.setattr(prompt_store, "MIN_TOKENS", MIN_TOKENS)


def flat(tokens: int) -> float:
    return 1.0


def prompt(length: int, seed: int = 0) -> list:
    """``length`` tokens of a tiny model's vocabulary, a pattern context drafts can follow."""
    return [(seed + 7 * i + (i // 5) * 3) % 90 + 3 for i in range(length)]


def decode(target, slot, ids, count):
    """``count`` tokens after ``ids`` in ``slot``, which then holds what was handed out (as a
    reply's end leaves it); the tokens and how many of ``ids`` were not read again."""
    slot.drafter = LookupDrafter(flat)
    decoder = SpeculativeDecoder(target, slot.drafter, Sampling(), cache=slot)
    tokens = [decoder.prefill(ids)]
    while len(tokens) < count:
        tokens += decoder.round(count - len(tokens)).tokens
    decoder.truncate(len(ids) + count)
    return tokens[:count], decoder.reused


def caches(target, directory, max_bytes=1 << 30):
    """A process's caches: in memory, and the store on disk."""
    return PromptCaches(target, max_bytes=1 << 30, store=PromptStore(directory, target, max_bytes=max_bytes))


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def test_a_restarted_process_continues_from_a_kept_prompt_and_decodes_plain_decodings_tokens(target, tmp_path):
    first = prompt(LONG)
    process = caches(target, tmp_path)
    slot = process.take(first)
    reply, reused = decode(target, slot, first, 8)
    assert reused == 0
    process.keep(slot)  # (the scheduler keeps a slot when its reply ends)
    assert len(list(tmp_path.rglob("*.safetensors"))) == 1

    restarted = caches(target, tmp_path)
    follow = first + reply + [5, 6, 7]
    slot = restarted.take(follow)
    tokens, reused = decode(target, slot, follow, 12)
    assert tokens == plain_tokens(target, follow, 12)
    assert reused == len(first) + len(reply) - 1, "the kept prompt was read again"

    # A prompt that shares only a beginning copies it from the loaded entry.
    other = first[:MIN_TOKENS] + prompt(40, seed=1)
    slot = caches(target, tmp_path).take(other)
    tokens, reused = decode(target, slot, other, 12)
    assert tokens == plain_tokens(target, other, 12) and reused == MIN_TOKENS


def test_a_newer_entry_replaces_what_it_extends_and_the_bound_holds(target, tmp_path):
    process = caches(target, tmp_path)
    first = prompt(LONG)
    slot = process.take(first)
    reply, _ = decode(target, slot, first, 4)
    process.keep(slot)
    continued = first + reply + prompt(MIN_TOKENS + 10, seed=2)
    slot = process.take(continued)
    decode(target, slot, continued, 4)
    process.keep(slot)
    [entry] = process.store.entries
    assert len(entry.tokens) == len(continued) + 4 and len(list(tmp_path.rglob("*.safetensors"))) == 1

    short = prompt(MIN_TOKENS // 2, seed=3)  # too few tokens to be worth a file
    slot = process.take(short)
    decode(target, slot, short, 4)
    process.keep(slot)
    assert len(process.store.entries) == 1

    size = entry.path.stat().st_size
    bounded = caches(target, tmp_path, max_bytes=size + size // 2)  # room for one entry only
    other = prompt(len(continued), seed=4)
    slot = bounded.take(other)
    decode(target, slot, other, 4)
    bounded.keep(slot)
    assert [e.tokens[:10] for e in bounded.store.entries] == [other[:10]], "the least recently used went"
    assert len(list(tmp_path.rglob("*.safetensors"))) == 1


def test_damaged_half_written_and_other_models_files_are_never_read(target, tmp_path, capsys):
    first = prompt(LONG)
    process = caches(target, tmp_path)
    slot = process.take(first)
    decode(target, slot, first, 4)
    process.keep(slot)
    [entry] = process.store.entries

    other_model = caches(tiny_target(seed=1), tmp_path)  # the same shapes, other weights
    assert other_model.store.entries == [] and other_model.store.directory != process.store.directory

    leftover = entry.path.parent / f".{entry.path.name}.abc{prompt_store.STAGED}"  # a writer killed mid-file
    leftover.write_bytes(b"\0" * 100)
    os.utime(leftover, (time.time() - 7200,) * 2)
    data = entry.path.read_bytes()
    entry.path.write_bytes(data[:len(data) // 2])  # cut short
    restarted = caches(target, tmp_path)
    assert not leftover.exists()
    slot = restarted.take(first + [4, 5])
    assert "removing the prompt cache" in capsys.readouterr().err
    tokens, reused = decode(target, slot, first + [4, 5], 6)
    assert tokens == plain_tokens(target, first + [4, 5], 6) and reused == 0
    assert not entry.path.exists() and restarted.store.entries == []

    entry.path.write_bytes(b"not a safetensors file")
    assert caches(target, tmp_path).store.entries == [] and not entry.path.exists()
    assert capsys.readouterr().err.count("removing the prompt cache") == 1


def test_caches_that_cannot_be_cut_back_are_not_kept(target, tmp_path):
    store = PromptStore(tmp_path, target)
    recurrent, full = [ArraysCache(2)], [KVCache()]
    full[0].update_and_fetch(mx.zeros((1, 2, LONG, 4)), mx.zeros((1, 2, LONG, 4)))
    tokens = list(range(LONG + 1))
    assert store.keeps(full, tokens, 0, 1 << 20) and not store.keeps(full, tokens, 200, 1 << 20)
    assert not store.keeps(recurrent, tokens, 0, 1 << 20)


def test_a_new_engine_reads_on_from_where_a_cancelled_read_in_a_closed_one_stopped(smollm, tmp_path, monkeypatch):
    """The real SmolLM2 behind an Engine (a server's) drafting from the context: a client
    leaves while its long prompt is read, the process ends, and in a new one its retry reads
    only what the finished chunks did not, its reply plain decoding's."""
    from mlx_eagle.engine import Engine

    model, tokenizer = smollm
    ids = tokenizer.encode(" ".join(["Write one line about the sea, the wind and the long grey harbour wall."] * 38))
    assert 600 < len(ids) < 700
    expected = plain(model, ids, 8, tokenizer.eos_token_ids).tokens
    monkeypatch.setenv("MLX_EAGLE_CACHE", str(tmp_path))

    def leave(read, total):
        if read >= 512:  # the first chunk read
            raise InterruptedError("the client gave up waiting")

    engine = Engine(loaded=(model, tokenizer, None), draft="lookup", history=False, prompt_disk_bytes=1 << 30)
    try:
        with pytest.raises(InterruptedError):
            list(engine.generate(ids, max_tokens=8, on_prompt_read=leave))
        deadline = time.monotonic() + 120
        while not engine.caches.store.entries and time.monotonic() < deadline:  # (kept as the reply ends)
            time.sleep(0.1)
    finally:
        engine.close()
    engine = Engine(loaded=(model, tokenizer, None), draft="lookup", history=False, prompt_disk_bytes=1 << 30)
    try:
        [kept] = engine.caches.store.entries  # the finished chunks at least (the reading may have gone on)
        assert len(kept.tokens) >= 513
        responses = list(engine.generate(ids, max_tokens=8))
    finally:
        engine.close()
    assert responses[-1].prompt_reused == min(len(kept.tokens), len(ids)) - 1
    assert [r.token for r in responses] == expected
