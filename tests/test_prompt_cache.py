"""A conversation's cache object (prompt_cache.PromptCache) on its own: what a new prompt
may reuse of it, what a verify pass leaves in it, cutting it to what was handed out, and
where a quantized cache turns, as plain mlx-lm's does."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache as mlx_lm_cache

from mlx_eagle.drafters import Drafter
from mlx_eagle.prompt_cache import make_prompt_cache
from mlx_eagle.target import KVQuantization


@pytest.fixture(scope="module")
def model():
    mx.random.seed(0)
    tiny = llama.Model(llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=64,
                                       num_attention_heads=2, rms_norm_eps=1e-5, vocab_size=50,
                                       num_key_value_heads=2))
    mx.eval(tiny.parameters())
    return tiny


def filled(model, tokens, kv=None):
    """A cache holding ``tokens`` (the last, the root, not read), as a decoder leaves it."""
    cache = make_prompt_cache(model)
    cache.bind(model, kv)
    model(mx.array([tokens[:-1]]), cache=cache.target)
    cache.quantize_when_due()
    cache.tokens = list(tokens)
    return cache


class Remembers(Drafter):
    def __init__(self, keeps):
        self.keeps = keeps

    def reusable(self, common):
        return min(common, self.keeps)


def test_a_prompt_reuses_what_it_shares_and_the_caches_are_cut_back_to_it(model):
    cache = filled(model, list(range(1, 21)))
    assert cache.reusable(list(range(1, 13)) + [40, 41], None) == 12
    assert cache.target[0].offset == 12 and cache.unread == 0
    cache = filled(model, list(range(1, 21)))
    assert cache.reusable(list(range(1, 31)), Remembers(5)) == 5  # the drafter keeps less: read from there
    assert cache.target[0].offset == 5


def test_a_verify_pass_keeps_the_accepted_rows_and_truncate_cuts_to_what_was_shown(model):
    cache = filled(model, list(range(1, 11)))  # 9 entries, root 10
    with cache.before_verify(3, 10, 0) as recorded:
        model(mx.array([[10, 11, 12, 13]]), cache=cache.target)  # the root and three drafts
    cache.commit(9, [0, 2], False, recorded)  # the root's row and the second draft's
    assert cache.target[0].offset == 11
    cache.tokens = list(range(1, 11)) + [12, 30]
    assert cache.truncate(11) and cache.tokens == list(range(1, 11)) + [12] and cache.target[0].offset == 10
    assert not cache.truncate(11) and not cache.truncate(0)  # nothing to cut


def test_a_quantized_cache_is_reused_only_past_where_plain_decoding_s_turns(model):
    kv = KVQuantization(4, 32, start=8)
    cache = filled(model, list(range(1, 21)), kv)
    assert isinstance(cache.target[0], QuantizedKVCache)
    assert cache.reusable(list(range(1, 16)) + [44, 45], None) == 0  # plain decoding reads these 15 in float
    assert type(cache.target[0]) is KVCache and cache.target[0].offset == 0
    cache = filled(model, list(range(1, 21)), kv)
    assert cache.reusable(list(range(1, 21)) + [44], None) == 0  # plain reads all 20 in float, then turns
    long = [1 + n % 49 for n in range(2100)]
    cache = filled(model, long, kv)
    assert cache.reusable(long + [44], None) == 2099  # plain turned after its first 2,048-token chunk: kept
    assert isinstance(cache.target[0], QuantizedKVCache)
    assert cache.room(19, 10) == 10 and filled(model, [1, 2, 3], kv).room(2, 10) == 6


@pytest.mark.parametrize("length, start", [(30, 8), (30, 0), (30, 20), (40, 33), (5, 3)])
def test_where_the_cache_turns_is_where_plain_mlx_lm_s_does(model, length, start):
    """KVQuantization.turns_at against mlx-lm's own loop, where it turns while reading a
    prompt: the entries its cache holds after the first chunk that leaves it quantized.
    (Past the prompt it turns on the step that reaches ``start``: max(start, length).)"""
    assert KVQuantization(4, 32, start=50).turns_at(length, step=16) == 50
    kv = KVQuantization(4, 32, start=start)
    cache = mlx_lm_cache(model)
    held = []
    steps = generate_step(mx.array(list(range(1, length + 1))), model, prompt_cache=cache, max_tokens=1,
                          kv_bits=4, kv_group_size=32, quantized_kv_start=start, prefill_step_size=16,
                          prompt_progress_callback=lambda read, total: held.append(
                              (cache[0].offset, isinstance(cache[0], QuantizedKVCache))))
    next(steps)
    turned = min(offset for offset, quantized in held if quantized)
    assert turned == kv.turns_at(length, step=16)


def test_a_sweep_of_one_off_prompts_leaves_a_conversation_that_went_on_warm(model):
    """The prefix cache (PromptCaches) evicts one-off prompts' slots before a conversation's
    that was continued, and never a slot in use (mlx-serve #378: a 32-document sweep evicted
    a live conversation)."""
    from mlx_eagle.prompt_cache import PromptCaches, cache_bytes

    def read(slot, tokens):
        model(mx.array([tokens[:-1]]), cache=slot.target)
        slot.tokens = list(tokens)

    conversation = list(range(1, 40))
    caches = PromptCaches(model, 1 << 30)
    first = caches.take(conversation)
    read(first, conversation)
    conversation += [41, 42, 43]
    assert caches.take(conversation) is first  # the conversation goes on in its slot
    read(first, conversation)
    caches.max_bytes = 3 * cache_bytes(first)  # room for about three slots like it
    busy = caches.take([44] * 45)
    read(busy, [44] * 45)
    for document in range(8):  # a sweep of unrelated prompts, each read once
        tokens = [document % 40 + 5] * 45
        read(caches.take(tokens, busy=[busy]), tokens)
    assert first in caches.slots and busy in caches.slots
    assert len(caches.slots) <= 4


def test_the_default_bound_is_sized_from_the_model_and_the_machine(model, monkeypatch):
    """Twice the weights, at least 256 MiB, at most an eighth of memory (2 GiB whatever the
    model let a 135M model's server hold 3.6 GB)."""
    import os

    from mlx_eagle import prompt_cache
    from mlx_eagle.prompt_cache import PromptCaches

    assert PromptCaches(model).max_bytes == 256 << 20  # a tiny model: the floor
    weights = 100 << 30
    monkeypatch.setattr(prompt_cache, "tree_flatten", lambda tree: [("w", type("Big", (), {"nbytes": weights})())])
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert PromptCaches(model).max_bytes == min(memory // 8, 2 * weights)
    assert PromptCaches(model, 5).max_bytes == 5


def test_a_request_waits_for_a_reading_it_shares_enough_with_and_not_for_a_long_one(model):
    """Scheduler._being_read: a waiting request whose beginning a prompt being read shares
    (agents starting together on one system prompt and tools) waits to copy it, where that
    beginning is SHARED_READ tokens or more past what the kept slots hold and the reading has
    at most SHARED_WAIT times that left; not behind a long prompt sharing a short beginning,
    nor for a beginning its own conversation's slot holds."""
    import queue
    import threading

    from mlx_eagle.prompt_cache import PromptCaches
    from mlx_eagle.scheduler import SHARED_READ, SHARED_WAIT, ReplyJob, Scheduler

    caches = PromptCaches(model, 1 << 30)
    scheduler = Scheduler(queue.Queue(), 4, 4, caches=caches)
    shared = [n % 40 + 1 for n in range(300)]  # (token ids of the tiny model's vocabulary)

    def job(ids, reading=False):
        request = ReplyJob(ids, lambda slot: None, threading.Event())
        request.reading = iter(()) if reading else None
        return request

    first = job(shared + [41, 42], reading=True)
    scheduler.live.append(first)
    assert scheduler._being_read(job(shared + [43]))  # 300 shared, 302 left: waits
    assert not scheduler._being_read(job(shared[:SHARED_READ - 1] + [49]))  # too short a beginning
    first.unread = SHARED_WAIT * 100 + 1  # (a longer prompt's rest)
    assert scheduler._being_read(job(shared[:100 + SHARED_READ] + [49]))
    assert not scheduler._being_read(job(shared[:100] + [49]))  # waiting would cost more than it saves
    first.unread = None
    caches.slots.append(filled(model, shared[:250]))  # its own conversation holds 249 of them
    assert not scheduler._being_read(job(shared + [43]))  # 51 more to share: read beside it
    first.reading = None  # read: nothing to wait for
    assert not scheduler._being_read(job(shared + [43]))
