"""A small model as the drafter (drafters/draft_model.py): greedy decoding identical to
plain mlx-lm with a good and a bad draft model, alone and merged with lookup, on tiny
models and on the real SmolLM2; its cache follows the accepted prefix; --draft takes a
model directory or GGUF; a draft model with another vocabulary gets one line.
(Sampling: tests/test_sampling.py.)"""


import mlx.core as mx
import pytest
from mlx_lm.models import llama

from mlx_eagle import plan_drafts, stream_generate
from mlx_eagle.decoder import SpeculativeDecoder
from mlx_eagle.drafters.composite import Composite
from mlx_eagle.drafters.draft_model import DraftModel, DraftModelDrafter
from mlx_eagle.drafters.lookup import LookupDrafter
from mlx_eagle.errors import UserError
from mlx_eagle.verify import Sampling
from commands import run_generate
from drafting import decode
from plain import plain_tokens

PROMPT = [5, 17, 33, 5, 17, 60, 2, 9, 41, 17]


def tiny(seed: int, vocab: int = 97) -> llama.Model:
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                                        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                                        vocab_size=vocab, max_position_embeddings=512, tie_word_embeddings=True,
                                        rope_theta=10000.0))
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("draft", ["the target itself", "another model", "merged with lookup"])
def test_greedy_decoding_equals_mlx_lm(draft):
    target = tiny(0)
    expected = plain_tokens(target, PROMPT, 48)
    drafting = target if draft == "the target itself" else tiny(1)
    drafter = DraftModelDrafter(drafting, lambda k: 1.0, 0.0, max_tokens=6)
    if draft == "merged with lookup":
        drafter = Composite([drafter, LookupDrafter(lambda k: 1.0)])
    tokens, decoder = decode(target, drafter, PROMPT, 48)
    assert tokens == expected
    if draft == "the target itself":  # every draft is accepted: 7 tokens a round (2 forwards read the prompt)
        assert decoder.forwards == 2 + -(-47 // 7)


def test_the_draft_cache_holds_the_accepted_prefix_after_every_round():
    target, drafting = tiny(0), tiny(1)
    drafter = DraftModelDrafter(drafting, lambda k: 1.0, 0.0, max_tokens=4)
    decoder = SpeculativeDecoder(target, drafter, Sampling())
    decoder.prefill(PROMPT)
    for _ in range(6):
        decoder.round(40)
        assert drafter.cache[0].offset == len(drafter.holding())
    # Cut back to what was committed and read on, the cache gives the draft model's own logits.
    logits = drafter._read(decoder.state.tokens)
    fresh = drafting(mx.array([decoder.state.tokens]))[0, -1]
    assert mx.allclose(logits, fresh, atol=1e-4)


def test_a_draft_model_with_another_vocabulary_is_refused():
    with pytest.raises(UserError, match="vocabulary of 50, the target 97"):
        plan_drafts(tiny(0), DraftModel(tiny(1, vocab=50), "small"))


@pytest.fixture(scope="module")
def smollm_dir(smollm_float32):
    return smollm_float32


def test_smollm2_drafting_for_itself_is_lossless_and_accepted(smollm, smollm_dir, monkeypatch):
    """The real model, loaded as a draft model through --draft's path, drafts for itself.
    Its draft step costs a whole target step (timed beside the target's curve, which may
    have been timed under another load: only its order is checked), so the plan's drafter
    never drafts (never slower than plain); drafting as if it were free, every draft is
    accepted."""
    from mlx_eagle.drafters import draft_model

    model, tokenizer = smollm
    plan = plan_drafts(model, str(smollm_dir), "auto", lookup=False)
    assert plan.describe() == f"draft model {smollm_dir.name}"
    cost = float(plan.notes[0].split("costs ")[1].split()[0])
    assert 0.2 < cost < 5.0, plan.notes
    monkeypatch.setattr(draft_model, "step_cost", lambda *args: 1.0)  # what it costs on a quiet machine
    plan = plan_drafts(model, str(smollm_dir), "auto", lookup=False)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Write a haiku about the sea."}],
                                        add_generation_prompt=True)
    expected = plain_tokens(model, ids, 40)
    for draft, tau in ((plan, 1.0), (DraftModelDrafter(plan.active[0].make().model, lambda k: 1.0, 0.0), 2.0)):
        responses = list(stream_generate(model, tokenizer, ids, max_tokens=40, draft=draft, lookup=False))
        tokens = [r.token for r in responses]
        assert tokens == expected[:len(tokens)] and (len(tokens) == 40 or tokens[-1] in tokenizer.eos_token_ids)
        assert responses[-1].tokens_per_forward > tau if tau > 1 else responses[-1].tokens_per_forward == 1.0


def test_the_command_takes_a_gguf_draft_model_and_says_so(smollm_gguf):
    def run(*args):
        return run_generate("--prompt", "Name three colors.",
                               "--max-tokens", "24", "--verbose", *args)

    drafted, plain = run("--draft", str(smollm_gguf)), run("--draft", "none")
    assert drafted.returncode == 0 and plain.returncode == 0, drafted.stderr[-2000:] + plain.stderr[-2000:]
    assert "drafts: draft model SmolLM2-135M-Instruct.Q4_1.gguf + context lookup" in drafted.stderr
    assert drafted.stdout == plain.stdout


def test_runner_up_leaves_stand_where_the_curve_pays_for_them():
    """On a flat curve (a GPU's) the draft model's second choices join the chain as leaves,
    and some are accepted where the chain token was not; on a curve where each verified
    token costs a third of a step (a CPU's) a chain that is always accepted stands alone.
    Both decode exactly as mlx-lm."""
    target = tiny(0)
    expected = plain_tokens(target, PROMPT, 64)
    flat = DraftModelDrafter(tiny(1), lambda k: 1.0, 0.0, max_tokens=4)
    tokens, _ = decode(target, flat, PROMPT, 64)
    assert tokens == expected and flat.runner_up_tried.sum() > 0 and flat.runner_up_taken.sum() > 0
    steep = DraftModelDrafter(target, lambda k: 1.0 + 0.3 * (k - 1), 0.0, max_tokens=4)
    tokens, decoder = decode(target, steep, PROMPT, 64)
    assert tokens == expected and steep.runner_up_tried.sum() == 0 and decoder.forwards < 64 // 3  # chains drafted
