"""Memory discipline on long replies: MLX's buffer cache is cleared whenever a round
crosses a multiple of 256 tokens (multi-token rounds jump over exact multiples, which is
how Ollama's MLX runner let a 27B model's cache grow past 90 GB) and after every reply,
and memory measured round after round over a 4k-token reply does not grow beyond its KV
cache."""

import threading

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
import pytest
from mlx_lm.models import llama

import mlx_eagle.costs
from mlx_eagle import stream_generate
from mlx_eagle.generation import CLEAR_CACHE_EVERY

REPLY = 4096


class Tokenizer:
    """Just what stream_generate asks of a tokenizer, for token ids with no text."""

    eos_token_ids = set()

    class detokenizer:  # noqa: N801 (mlx-lm's attribute name)
        text = ""

        @staticmethod
        def reset():
            pass

        @staticmethod
        def add_token(token):
            pass

        @staticmethod
        def finalize():
            pass


@pytest.fixture(scope="module")
def looping_model():
    """A tiny llama whose greedy text soon repeats, so that context drafts make rounds of
    many tokens. Its weights are drawn from keys of its own, as mlx-lm initializes them: the
    global generator may be drawn from meanwhile by another test's engine thread."""
    args = llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                           num_attention_heads=4, rms_norm_eps=1e-5, vocab_size=48, num_key_value_heads=2,
                           max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=10000.0)
    model = llama.Model(args)
    keys = mx.random.split(mx.random.key(3), len(tree_flatten(model.parameters())))
    drawn = []
    for key, (name, value) in zip(keys, tree_flatten(model.parameters())):
        if "norm" in name:
            drawn.append((name, value))
        elif "embed_tokens" in name:
            drawn.append((name, mx.random.normal(value.shape, key=key)))
        else:
            scale = value.shape[-1] ** -0.5
            drawn.append((name, mx.random.uniform(-scale, scale, value.shape, key=key)))
    model.update(tree_unflatten(drawn))
    mx.eval(model.parameters())
    return model


def test_the_cache_is_cleared_at_every_crossing_and_memory_stays_flat(looping_model, monkeypatch, tmp_path):
    # (a cache of its own, no earlier replies: what other tests' tiny llamas of these sizes left in
    # the session's cache and history must not decide how far this one drafts)
    monkeypatch.setenv("MLX_EAGLE_CACHE", str(tmp_path))
    monkeypatch.setattr(mlx_eagle.costs, "_CURVES", {})
    cleared, active = [], []
    clear, here = mx.clear_cache, threading.get_ident()

    def counted():  # this thread's calls: another test's engine thread may be finishing
        if threading.get_ident() == here:
            cleared.append(mx.get_cache_memory())
        clear()

    monkeypatch.setattr(mx, "clear_cache", counted)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8] * 4
    lengths = []
    for response in stream_generate(looping_model, Tokenizer(), prompt, max_tokens=REPLY, draft="lookup",
                                    history=False):
        if response.from_draft is False:  # a round's last token: memory as the round left it
            lengths.append(len(prompt) + response.generation_tokens)
            active.append(mx.get_active_memory())
    assert response.generation_tokens == REPLY and response.tokens_per_forward > 2  # rounds of many tokens
    crossings = sum(1 for before, after in zip(lengths, lengths[1:])
                    if before // CLEAR_CACHE_EVERY != after // CLEAR_CACHE_EVERY)
    assert crossings >= REPLY // CLEAR_CACHE_EVERY - 1
    assert len(cleared) == crossings + 1  # each crossing, and once after the reply
    # What a round leaves allocated grows with the KV cache alone (a few KB a token here),
    # not with the reply's rounds: the second half of the reply adds about what the first
    # did (a buffer kept per round would add megabytes over a thousand rounds).
    quarter = len(active) // 4
    first, second = active[2 * quarter] - active[quarter], active[-1] - active[2 * quarter]
    assert second <= first + (8 << 20), (first, second, len(active))
