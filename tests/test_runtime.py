"""The runtime's contracts: one target forward per round, head files in the official
layouts, tree specs, and one clear line for each kind of bad input."""

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlx_eagle.errors import UserError
from drafting import decoder as make_decoder
from mlx_eagle.heads import load_head, new_head, save_head
from mlx_eagle.trees import DEFAULT_STATIC, parse_tree
from mlx_eagle.verify import Sampling
from oracle import OracleHead
from synthetic import write_model

from commands import run_generate
from plain import plain_tokens

@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from mlx_eagle.convert.target import convert_target
    from mlx_eagle import load

    root = tmp_path_factory.mktemp("tiny")
    path = convert_target(write_model(root, "qwen3")["hf"], root / "mlx", progress=False)
    model, tokenizer = load(str(path))
    return model, tokenizer, path


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("tree", ["chain:6", "static:default", "dynamic:topk=5,depth=4,tokens=20"])
def test_a_tree_costs_one_target_forward_per_round(tiny_llama, tree, compiled, monkeypatch, compiling):
    """Every round verifies its whole tree in one target forward: counted at the model's
    final norm where the pass runs eagerly, at the compiled call where it is one."""
    from mlx_eagle import compiled as compiling_module, decoder as decoding

    model, _, _ = tiny_llama
    compiling(compiled)
    blocks = []
    monkeypatch.setattr(decoding, "verify_block", lambda model, tokens, *args: blocks.append(tokens.size) or
                        compiling_module.verify_block(model, tokens, *args))
    calls = []
    norm = model.model.norm

    class CountingNorm(type(norm)):
        def __call__(self, x):
            calls.append(x.shape[1])
            return super().__call__(x)

    counting = CountingNorm(norm.weight.shape[0], eps=norm.eps)
    counting.weight = norm.weight
    model.model.norm = counting
    try:
        sequence = list(range(3, 60))
        decoder = make_decoder(model, OracleHead(sequence, model.args.vocab_size), tree, Sampling())
        decoder.prefill(sequence[:5])
        assert len(calls) == 1
        for round_number in range(1, 6):
            result = decoder.round(40)
            passes = blocks if compiled else calls[1:]  # (a compiled call runs the norm only when traced)
            assert len(passes) == round_number and decoder.forwards == 1 + round_number
            assert passes[-1] == 1 + result.drafted  # the whole tree in that one pass
            assert result.drafted == parse_tree(tree).max_nodes
    finally:
        model.model.norm = norm


@pytest.mark.parametrize("family", ["eagle1", "eagle3"])
def test_head_round_trips_in_the_official_layout(tiny_llama, tmp_path, family):
    model, _, _ = tiny_llama
    head = new_head(model, family, draft_vocab_size=64 if family == "eagle3" else None, seed=3)
    save_head(head, tmp_path / "head")
    keys = set(mx.load(str(tmp_path / "head" / "model.safetensors")))
    if family == "eagle1":
        assert {"fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.post_attention_layernorm.weight"} <= keys
        assert not any("input_layernorm" in k for k in keys)
    else:
        assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight",
                "midlayer.input_layernorm.weight", "norm.weight", "lm_head.weight", "d2t"} <= keys
        assert mx.load(str(tmp_path / "head" / "model.safetensors"))["midlayer.self_attn.q_proj.weight"].shape[1] \
            == 2 * model.args.hidden_size
    loaded = load_head(tmp_path / "head", model)
    for (name, a), (_, b) in zip(tree_flatten(head.parameters()), tree_flatten(loaded.parameters())):
        assert mx.array_equal(a, b), name


def test_tree_specs():
    assert parse_tree("chain:3").paths == [(0,), (0, 0), (0, 0, 0)]
    assert parse_tree("static:default").paths == sorted(DEFAULT_STATIC, key=lambda p: (len(p), p))
    dynamic = parse_tree("dynamic:topk=8,depth=5,tokens=32")
    assert (dynamic.kind, dynamic.topk, dynamic.depth, dynamic.tokens) == ("dynamic", 8, 5, 32)
    for bad in ["chain:x", "chain:0", "static:/nope.json", "dynamic:topk=8,width=3", "bush:4", "dynamic:topk=0"]:
        with pytest.raises(UserError):
            parse_tree(bad)


def test_static_tree_file(tmp_path):
    (tmp_path / "tree.json").write_text(json.dumps([[0], [1], [0, 0], [1, 0]]))
    assert parse_tree(f"static:{tmp_path / 'tree.json'}").paths == [(0,), (1,), (0, 0), (1, 0)]
    (tmp_path / "orphan.json").write_text(json.dumps([[0], [1, 0]]))
    with pytest.raises(UserError, match="no parent"):
        parse_tree(f"static:{tmp_path / 'orphan.json'}")


def assert_one_line_error(result, *words):
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line and not line.startswith("hint:")]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for word in words:
        assert word in lines[0], lines[0]


@pytest.fixture(scope="module")
def other_heads(tiny_llama, tmp_path_factory):
    """Heads made for other targets: wider, and with another vocabulary."""
    from mlx_lm.models import qwen3

    model, _, _ = tiny_llama
    root = tmp_path_factory.mktemp("heads")
    wide = dict(vars(model.args), hidden_size=96, num_attention_heads=6, head_dim=16)
    save_head(new_head(qwen3.Model(qwen3.ModelArgs.from_dict(wide)), "eagle3"), root / "wide")
    other_vocab = dict(vars(model.args), vocab_size=model.args.vocab_size + 32)
    save_head(new_head(qwen3.Model(qwen3.ModelArgs.from_dict(other_vocab)), "eagle1"), root / "vocab")
    return root


def test_head_of_another_width(tiny_llama, other_heads):
    result = run_generate("--model", str(tiny_llama[2]), "--draft", str(other_heads / "wide"), "--max-tokens", "4")
    assert_one_line_error(result, "does not fit", "hidden size 96")


def test_head_of_another_vocabulary(tiny_llama, other_heads):
    result = run_generate("--model", str(tiny_llama[2]), "--draft", str(other_heads / "vocab"), "--max-tokens", "4")
    assert_one_line_error(result, "does not fit", "vocabulary")


def test_missing_head_files(tiny_llama, tmp_path):
    model_dir = str(tiny_llama[2])
    assert_one_line_error(run_generate("--model", model_dir, "--draft", str(tmp_path / "absent")), "does not exist")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(run_generate("--model", model_dir, "--draft", str(tmp_path / "empty")), "config.json")
    save_head(new_head(tiny_llama[0], "eagle1"), tmp_path / "no-weights")
    (tmp_path / "no-weights" / "model.safetensors").unlink()
    assert_one_line_error(run_generate("--model", str(tiny_llama[2]), "--draft", str(tmp_path / "no-weights")),
                          "safetensors")


def test_malformed_tree(tiny_llama):
    assert_one_line_error(run_generate("--model", str(tiny_llama[2]), "--tree", "dynamic:topk=8,deep=2"), "deep")


def test_prompt_longer_than_the_context(tiny_llama):
    long_prompt = "hello world " * 400  # the tiny_llama model's context holds 256 tokens
    assert_one_line_error(run_generate("--model", str(tiny_llama[2]), "--prompt", long_prompt), "context")


def test_generation_stops_at_the_context_end(tiny_llama):
    model, tokenizer, _ = tiny_llama
    from mlx_eagle import stream_generate

    ids = list(range(3, 250))
    responses = list(stream_generate(model, tokenizer, ids, max_tokens=100, draft=new_head(model, "eagle1"),
                                     tree="chain:4"))
    assert responses[-1].finish_reason in ("length", "stop")
    assert len(ids) + len(responses) <= model.args.max_position_embeddings


def test_stop_strings(tiny_llama):
    model, tokenizer, _ = tiny_llama
    from mlx_eagle import generate

    full = generate(model, tokenizer, "The quick brown fox", max_tokens=30)
    assert len(full) > 6
    stop = full[3:6]
    text = generate(model, tokenizer, "The quick brown fox", max_tokens=30, stop=[stop])
    assert text == full[: full.find(stop)]


def test_a_stop_string_split_across_tokens_is_never_shown():
    from mlx_eagle.generation import StopMatcher

    matcher = StopMatcher(["END", ""])
    pieces = [matcher.feed(text, final=False) for text in ("abc", "abcE", "abcEN", "abcENDxyz")]
    assert pieces == [("a", None), ("b", None), ("c", None), ("", "END")]
    unfinished = StopMatcher(["END", "cE"])
    assert unfinished.feed("abcEN", final=False) == ("ab", "cE")  # the earliest stop string is the one that ended it
    unfinished = StopMatcher(["END"])
    assert unfinished.feed("abcEN", final=False) == ("abc", None)
    assert unfinished.feed("abcEN", final=True) == ("EN", None)  # the text ended: nothing to hold back


def test_draft_auto_finds_the_shipped_head_by_the_models_identity_not_its_path(smollm_float32, tmp_path):
    """A Hub snapshot path and a plain directory name hold the same SmolLM2: both get its
    head; another model gets none."""
    import shutil

    from mlx_eagle.convert.target import convert_target
    from mlx_eagle import load
    from mlx_eagle.heads import shipped_head_dir
    from synthetic import write_model

    snapshot = tmp_path / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "snapshots" / "0123abcd"
    shutil.copytree(smollm_float32, snapshot)
    for directory in (snapshot, smollm_float32):
        model, _, head = load(str(directory), draft="auto")
        assert head is not None and head.directory == shipped_head_dir(model), directory
    other = convert_target(write_model(tmp_path, "llama")["hf"], tmp_path / "other", progress=False)
    assert load(str(other), draft="auto")[2] is None


def test_importing_the_generate_command_keeps_the_generate_function():
    import importlib

    import mlx_eagle

    importlib.import_module("mlx_eagle.generate.__main__")  # the command, as python -m and the corpus tests load it
    import mlx_eagle.generate  # noqa: F811 (the command's package, imported by name)

    assert callable(mlx_eagle.generate) and mlx_eagle.generate.__module__ == "mlx_eagle.generation"


def _proposals(model, head, prompt, max_tokens, cost):
    """The decoder's rounds with ``head`` drafting the default static tree held to ``cost``:
    the tokens, and in how many rounds the head proposed."""
    from mlx_eagle.decoder import SpeculativeDecoder
    from mlx_eagle.drafters.eagle import EagleDrafter
    from mlx_eagle.trees import parse_tree
    from mlx_eagle.verify import Sampling

    drafter = EagleDrafter(head, model, parse_tree("static:default"), cost)
    proposed, original = [], drafter.propose
    drafter.propose = lambda budget: (lambda p: proposed.append(p is not None) or p)(original(budget))
    decoder = SpeculativeDecoder(model, drafter, Sampling(), seed=0)
    tokens = [decoder.prefill(prompt)]
    while len(tokens) < max_tokens:
        tokens += decoder.round(max_tokens - len(tokens)).tokens
    return tokens[:max_tokens], proposed


def test_a_head_whose_tree_does_not_pay_drafts_only_probes(smollm):
    """On a curve where verifying a tree costs nearly nothing (a GPU's), a random head (no
    acceptance recorded, none measured) is held back after its warm-up to one probe round
    in 16, while the shipped head keeps drafting; both stay lossless."""

    from mlx_eagle.drafters.eagle import EagleDrafter
    from mlx_eagle.replies import chat_tokens
    from mlx_eagle.heads import new_head
    from mlx_eagle.heads import shipped_head_dir

    model, tokenizer = smollm
    prompt = chat_tokens(tokenizer, [{"role": "user", "content": "Tell me about the history of Paris."}])
    expected = plain_tokens(model, prompt, 80)

    def gpu(k):
        return 1.0 + 0.02 * (k - 1)

    tokens, proposed = _proposals(model, new_head(model, "eagle3", draft_vocab_size=512, seed=3), prompt, 80, gpu)
    assert tokens == expected
    later = proposed[EagleDrafter.WARMUP + 1:]
    assert len(later) > 40 and sum(later) <= len(later) // EagleDrafter.PROBE + 2, proposed
    tokens, proposed = _proposals(model, load_head(shipped_head_dir(model), model), prompt, 80, gpu)
    assert tokens == expected and sum(proposed) >= 0.9 * len(proposed)


def test_a_head_whose_tree_could_not_pay_even_if_all_accepted_does_not_probe(smollm):
    """Where every verified token costs a full step (a tree of the default's size could not
    pay were every node on its deepest path accepted, as beside many rows on this CPU), a
    held-back head does not probe at all, reading what was committed in one pass only once
    more than two chunks wait; the text stays plain decoding's."""
    from mlx_eagle.drafters.eagle import EagleDrafter
    from mlx_eagle.heads import new_head
    from mlx_eagle.replies import chat_tokens

    model, tokenizer = smollm
    prompt = chat_tokens(tokenizer, [{"role": "user", "content": "Tell me about the history of Paris."}])
    tokens, proposed = _proposals(model, new_head(model, "eagle3", draft_vocab_size=512, seed=3), prompt, 80,
                                  lambda k: float(k))
    assert tokens == plain_tokens(model, prompt, 80)
    later = proposed[EagleDrafter.WARMUP + 1:]
    assert len(later) > 40 and not any(later), proposed
