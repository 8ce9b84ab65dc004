"""Self-distillation on the real SmolLM2: a batch of prompts of different lengths is
answered exactly as plain mlx-lm greedy decoding answers each alone, and more prompts
extend the answers made before."""

import numpy as np
import pytest

from mlx_eagle.data import load_shards
from mlx_eagle.features import greedy_batch
from plain import plain_tokens

PROMPTS = ["Name a colour.", "Write one sentence about the moon and the tides.",
           "What is the largest planet in our solar system? Answer briefly, please."]
MAX_ANSWER = 24


def test_batch_answers_equal_plain_greedy_decoding(smollm):
    model, tokenizer = smollm
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
           for p in PROMPTS]
    assert len({len(i) for i in ids}) == len(ids)  # different lengths: teacher forcing inside the batch
    answered = greedy_batch(model, ids, MAX_ANSWER, tokenizer.eos_token_ids)
    for prompt, tokens in zip(ids, answered):
        assert list(tokens[len(prompt):]) == plain_tokens(model, prompt, MAX_ANSWER, tokenizer.eos_token_ids)


@pytest.mark.slow  # real processes with the real model
def test_more_prompts_extend_the_data_made_before(tmp_path):
    """--prompts 2 then 3: the third prompt's answer is added in a shard of its own, the
    first two's are kept (their draft vocabulary too); asking for fewer is one clear error."""
    from mlx_eagle.errors import UserError
    from mlx_eagle.train.__main__ import main

    def prepare(prompts):
        main(["--out", str(tmp_path / "head"), "--data", str(tmp_path), "--answers", "self", "--prompts", str(prompts),
              "--held-out", "0",
              "--max-answer-tokens", "6", "--draft-vocab", "64", "--prepare-only", "--quiet"])

    prepare(2)
    before = load_shards(tmp_path / "data-self")
    vocab = (tmp_path / "vocab-self-64.npz").read_bytes()
    prepare(3)
    after = load_shards(tmp_path / "data-self")
    assert len(before) == 2 and len(after) == 3
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(before, after))
    assert (tmp_path / "vocab-self-64.npz").read_bytes() == vocab
    with pytest.raises(UserError, match="--prompts 3"):
        prepare(2)
