"""Speculation on hybrid and recurrent models (rewind.py): for every family mlx-lm loads
(tests/hybrids.py), greedy decoding with drafts that are accepted part way equals
mlx_lm.generate_step token for token, so the recurrent state after each round is exactly
the state after the accepted prefix; the same with a draft model; the test can fail
(without the rollback the text changes); the recorded rollback leaves what reading the
prefix alone does, and its fallback, a snapshot, is lossless too; and a conversation keeps its cache across turns."""

import mlx.core as mx
import pytest

import hybrids
from oracle import ScriptedDrafter
from mlx_eagle.prompt_cache import make_prompt_cache
from mlx_eagle.drafters.composite import Composite
from mlx_eagle.drafters.draft_model import DraftModelDrafter
from mlx_eagle.drafters.lookup import LookupDrafter
from mlx_eagle.rewind import Rewind
from commands import run_generate
from hybrids import COUNT, PROMPT, decode, reference, text_model, write_directory


@pytest.fixture(scope="module", params=list(hybrids.FAMILIES))
def family(request):
    return request.param, hybrids.build(request.param)


# The families whose Mamba 2 layers are rolled back from a snapshot, as measured cheaper
# (rewind.RECURRENCES); every other family's rollbacks replay the recorded pass.
SNAPSHOT_FAMILIES = {"nemotron_h", "granitemoehybrid", "falcon_h1", "mamba2"}


def test_drafts_accepted_part_way_are_rolled_back_losslessly(family):
    """Chains that are accepted part way (a drafter that knows the continuation, with
    planned mistakes), merged with context lookup."""
    name, model = family
    expected = reference(model)
    drafter = Composite([ScriptedDrafter(PROMPT + expected, hybrids.VOCAB), LookupDrafter(lambda k: 1.0)])
    tokens, decoder = decode(model, drafter)
    assert tokens == expected, name
    assert COUNT / decoder.forwards > 1.5, f"{name}: tau {COUNT / decoder.forwards:.2f}: drafts were accepted"
    assert decoder.rewind is not None and decoder.rewind.replays == (name not in SNAPSHOT_FAMILIES)


@pytest.mark.parametrize("name", ["qwen3_5", "nemotron_h", "jamba", "lfm2", "kimi_linear"])
@pytest.mark.parametrize("stepped", [True, False])
def test_the_recorded_rollback_equals_reading_the_prefix(monkeypatch, name, stepped):
    """After a pass over 7 tokens cut back to its first 3, every cache holds what a pass
    over those 3 alone leaves: the conv states sliced, the recurrent states kept as they
    passed (``stepped``, as on CPU and CUDA) or replayed over the kept steps (as on Metal).
    Mamba 2 layers replay (the decoder restores a snapshot for them instead)."""
    import mlx_eagle.rewind as rewind_module

    model = hybrids.build(name)
    rewind_cache, plain_cache = make_prompt_cache(model).target, make_prompt_cache(model).target
    for cache in (rewind_cache, plain_cache):
        mx.eval(model(mx.array([PROMPT]), cache=cache))
    rewind = Rewind(model, rewind_cache, replay=True)
    if not stepped:
        monkeypatch.setattr(rewind_module, "_Call", _unstepped(rewind_module._Call))
    snapshot = rewind.snapshot()
    with rewind.recording() as recorded:
        mx.eval(model(mx.array([[3, 1, 4, 1, 5, 9, 2]]), cache=rewind_cache))
    assert rewind.cut_back(snapshot, recorded, 3)
    mx.eval(model(mx.array([[3, 1, 4]]), cache=plain_cache))
    for kept, read in zip(rewind.caches, Rewind(model, plain_cache).caches):
        if hasattr(kept, "offset"):  # an attention layer's: cut back to the same length
            assert kept.offset == read.offset
            continue
        for a, b in zip(kept.cache, read.cache):
            assert a.shape == b.shape and mx.allclose(a, b, atol=1e-5), name
    # and the next token's logits agree
    a = model(mx.array([[6]]), cache=rewind_cache)
    b = model(mx.array([[6]]), cache=plain_cache)
    assert mx.allclose(a, b, atol=1e-4)


def _unstepped(call_class):
    """A recorded call that forgets the states its steps kept: its rollback replays."""
    class Unstepped(call_class):
        def __init__(self, *args):
            super().__init__(*args)
            self.steps = []
    return Unstepped


@pytest.mark.parametrize("name", ["qwen3_next", "falcon_h1"])
def test_the_snapshot_fallback_is_lossless(monkeypatch, name):
    """Where the recording cannot account for a model's states, the round restores its
    snapshot and reads the accepted tokens again."""
    model = hybrids.build(name)
    expected = reference(model)
    monkeypatch.setattr(Rewind, "cut_back", lambda self, snapshot, recorded, count: False)
    tokens, decoder = decode(model, ScriptedDrafter(PROMPT + expected, hybrids.VOCAB), replays=False)
    assert tokens == expected and decoder.forwards < COUNT


def test_lookup_alone_is_lossless(family):
    name, model = family
    tokens, _ = decode(model, LookupDrafter(lambda k: 1.0))
    assert tokens == reference(model), name


@pytest.mark.parametrize("name", ["qwen3_next", "nemotron_h", "lfm2"])
def test_a_draft_model_merged_with_lookup_is_lossless(name):
    model = hybrids.build(name)
    draft = hybrids.build(name, seed=5)  # other weights: its drafts are mostly rejected, part way
    drafter = Composite([DraftModelDrafter(draft, lambda k: 1.0, 0.0, max_tokens=4), LookupDrafter(lambda k: 1.0)])
    tokens, _ = decode(model, drafter)
    assert tokens == reference(model)


@pytest.mark.parametrize("name", ["qwen3_5", "nemotron_h", "lfm2"])
def test_a_hybrid_draft_model_rolls_its_own_state_back(monkeypatch, name):
    """A hybrid draft model drafts 4 tokens, of which the target accepts 1 and then chooses
    another: its state goes back to the snapshot taken at the accepted length, so that what
    it predicts next is what it predicts after reading the committed text from the start;
    without the rollback it is not."""
    from mlx_eagle.drafters import Budget, Outcome

    def next_logits():
        draft = hybrids.build(name, seed=5)
        drafter = DraftModelDrafter(draft, lambda k: 1.0, 0.0, max_tokens=4)
        committed = PROMPT + [7]
        drafter.observe(Outcome(committed, 0, from_prompt=True))
        proposal = drafter.propose(Budget(room=10, nodes=16, verified=1, chain=True))
        chain = proposal.host_tokens()
        assert len(chain) == 4
        committed = committed + chain[:1] + [(chain[1] + 1) % hybrids.VOCAB]  # one accepted, then another token
        drafter.observe(Outcome(committed, len(PROMPT), proposal=proposal, path=[0]))
        return drafter._read(committed), draft(mx.array([committed]))[0, -1]

    rolled_back, read_whole = next_logits()
    assert mx.allclose(rolled_back, read_whole, atol=1e-4)
    monkeypatch.setattr(Rewind, "restore", lambda self, snapshot: None)
    kept_on, read_whole = next_logits()
    assert not mx.allclose(kept_on, read_whole, atol=1e-2)


@pytest.mark.parametrize("name", ["qwen3_next", "jamba", "lfm2", "nemotron_h"])
def test_without_the_rollback_the_text_changes(monkeypatch, name):
    model = hybrids.build(name)
    expected = reference(model)
    monkeypatch.setattr(Rewind, "cut_back", lambda self, snapshot, recorded, count: True)  # keeps the whole pass
    tokens, _ = decode(model, ScriptedDrafter(PROMPT + expected, hybrids.VOCAB))
    assert tokens != expected


def test_a_second_turn_reads_only_its_new_tokens():
    model = hybrids.build("qwen3_5")
    cache = make_prompt_cache(model)
    first, decoder = decode(model, LookupDrafter(lambda k: 1.0), count=20, cache=cache)
    turn = PROMPT + first[:-1] + [3, 4, 5, 6]  # the conversation so far, and a new message
    tokens, decoder = decode(model, LookupDrafter(lambda k: 1.0), prompt=turn, count=20, cache=cache)
    assert decoder.reused > len(PROMPT) + len(first) - 1 - 8  # all the cache held (less what was still unread)
    assert tokens == reference(model, turn, 20)
    # A prompt that leaves the conversation cannot cut a recurrent state back: read from the start.
    other = [7, 7] + PROMPT
    tokens, decoder = decode(model, LookupDrafter(lambda k: 1.0), prompt=other, count=10, cache=cache)
    assert decoder.reused == 0 and tokens == reference(model, other, 10)


@pytest.mark.parametrize("name", ["qwen3_next", "lfm2"])
def test_the_command_drafts_on_a_hybrid_directory_and_conversion_keeps_it(tmp_path, name):

    from mlx_eagle import load
    from mlx_eagle.convert.target import convert_target

    directory = write_directory(tmp_path, name)

    def run(*args):
        return run_generate("--model", str(directory), "--prompt",
                               "The quick brown fox. The quick brown fox. The quick", "--max-tokens", "30",
                               "--verbose", *args)

    drafted, plain = run("--draft", "lookup"), run("--draft", "none")
    assert drafted.returncode == 0 and plain.returncode == 0, drafted.stderr[-2000:] + plain.stderr[-2000:]
    assert "drafts: context lookup" in drafted.stderr and drafted.stdout == plain.stdout
    (tmp_path / "draft").mkdir()
    by_model = run("--draft", str(write_directory(tmp_path / "draft", name)))  # a hybrid draft model
    assert by_model.returncode == 0, by_model.stderr[-2000:]
    assert "draft model" in by_model.stderr and by_model.stdout == plain.stdout
    converted, _ = load(str(convert_target(directory, tmp_path / "converted", progress=False)))
    original, _ = load(str(directory))
    tokens = mx.array([[5, 17, 33, 5, 17, 60]])
    assert mx.allclose(converted(tokens), original(tokens), atol=1e-5)


def test_a_hybrid_gguf_is_refused_in_one_line(tmp_path):
    import gguf
    import numpy as np

    from mlx_eagle.convert.target import convert_target
    from mlx_eagle.errors import UserError

    path = tmp_path / "falcon-h1.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon-h1")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UserError, match="'falcon-h1' is not supported .* Hugging Face directory"):
        convert_target(path, tmp_path / "out", progress=False)


def test_a_conversation_on_a_hybrid_model_reads_only_each_new_turn(tmp_path):
    """Turns through stream_generate with one prompt cache, as ChatSession runs them: each
    turn's prompt is the conversation so far (the replies as they were handed out, though
    the last round committed tokens past their end) and a new message; it reads only what
    is new."""
    from mlx_eagle import load, make_prompt_cache, stream_generate

    model, tokenizer = load(str(write_directory(tmp_path, "qwen3_5")))
    cache = make_prompt_cache(model)
    conversation, reused = [5, 6, 7, 8, 9], []
    for turn in range(3):
        expected = reference(model, conversation, 12)
        tokenizer._eos_token_ids = {expected[4]}  # the reply ends inside a drafted chain
        expected = expected[:expected.index(expected[4]) + 1]
        responses = list(stream_generate(model, tokenizer, conversation, max_tokens=12, prompt_cache=cache,
                                         draft=ScriptedDrafter(conversation + reference(model, conversation, 12),
                                                               model.args.vocab_size, length=8, wrong_every=50)))
        assert [r.token for r in responses] == expected
        assert cache.tokens == conversation + expected  # not what the last round committed past the end
        reused.append((responses[-1].prompt_reused, len(conversation)))
        conversation = conversation + expected + [10 + turn, 11 + turn]
    assert reused[0][0] == 0
    for (cached, _), (_, previous_prompt) in zip(reused[1:], reused):
        assert cached >= previous_prompt, reused  # all of the last turn, at least


# The families an EAGLE-3 head can be shaped for (Mamba 2 has no attention sizes to take;
# the tiny Kimi Linear has too few layers for the default taps).
HEAD_FAMILIES = [name for name in hybrids.FAMILIES if name not in ("mamba2", "kimi_linear")]


class _StatesRecorder(ScriptedDrafter):
    """Scripted chains (accepted part way, so rolled back) that read the target's states at
    ``taps`` and keep what each outcome delivered."""

    def __init__(self, sequence, vocab_size, taps):
        super().__init__(sequence, vocab_size)
        self.taps, self.read = tuple(taps), {}

    def observe(self, outcome):
        super().observe(outcome)
        states = outcome.states.read(self.taps)
        for row, position in enumerate(range(outcome.start, len(outcome.tokens) - 1)):
            self.read[position] = states[row]


@pytest.mark.parametrize("name", ["qwen3_next", "nemotron_h", "lfm2"])
def test_the_states_read_from_a_hybrid_are_those_of_the_committed_text(name):
    """What a drafter reads each round (from verify passes that ran past rejected drafts and
    were rolled back, the accepted tokens read again) equals one forward pass over the
    committed text: the features an EAGLE-3 head drafts from are exact."""
    from mlx_eagle.target import tapped_forward

    model = hybrids.build(name)
    expected = reference(model)
    taps = (1, 3) if name != "nemotron_h" else (1, 2)
    drafter = _StatesRecorder(PROMPT + expected, hybrids.VOCAB, taps)
    tokens, decoder = decode(model, drafter)
    assert tokens == expected and COUNT / decoder.forwards > 1.5
    committed = PROMPT + tokens
    whole = tapped_forward(model, mx.array([committed]), make_prompt_cache(model).target, taps).features[0]
    positions = sorted(drafter.read)
    assert positions == list(range(len(positions))) and len(positions) >= len(PROMPT) + COUNT - 8
    read = mx.stack([drafter.read[p] for p in positions])
    difference = mx.abs(read - whole[:len(positions)]).max().item()
    assert difference < 1e-3 * mx.abs(whole).max().item(), (name, difference)


@pytest.mark.parametrize("name", HEAD_FAMILIES)
def test_an_eagle3_head_drafts_chains_on_a_hybrid_losslessly(name):
    """A random EAGLE-3 head (its chains rejected, rolled back each round), merged with
    lookup: the text of plain decoding."""
    from mlx_eagle.drafters.eagle import EagleDrafter
    from mlx_eagle.heads import new_head
    from mlx_eagle.trees import parse_tree

    model = text_model(hybrids.build(name))
    drafter = EagleDrafter(new_head(model, "eagle3", seed=1), model, parse_tree("chain:3"))
    proposed = []
    propose = drafter.propose
    drafter.propose = lambda budget: proposed.append(propose(budget)) or proposed[-1]
    tokens, decoder = decode(model, Composite([drafter, LookupDrafter(lambda k: 1.0)]), count=24)
    assert tokens == reference(model, count=24), name
    assert sum(1 for p in proposed if p is not None and len(p)) >= 10


def test_a_tree_asked_of_a_hybrid_is_drafted_as_its_chain():
    from mlx_eagle.drafters.kinds import DraftSettings
    from mlx_eagle.drafters.eagle import source
    from mlx_eagle.heads import new_head

    model = text_model(hybrids.build("qwen3_5"))
    made = source(new_head(model, "eagle3"), model, DraftSettings(model, "static:default")).make()
    assert made.grower.spec.paths == [(0,) * d for d in range(1, 6)]


@pytest.mark.parametrize("name", ["qwen3_next", "nemotron_h", "lfm2", "jamba"])
def test_an_eagle1_head_reads_the_post_norm_state_of_a_hybrid_losslessly(name):
    """EAGLE-1/2 heads read the state leaving the model's final norm (each family names it
    its own way), recorded on its own forward pass."""
    from mlx_eagle.drafters.eagle import EagleDrafter
    from mlx_eagle.heads import new_head
    from mlx_eagle.target import tapped_forward
    from mlx_eagle.trees import parse_tree

    model = hybrids.build(name)
    out = tapped_forward(model, mx.array([PROMPT]), make_prompt_cache(model).target, ())
    assert mx.allclose(out.logits, model(mx.array([PROMPT])), atol=1e-5)
    assert out.features.shape == (1, len(PROMPT), model.args.hidden_size)
    drafter = EagleDrafter(new_head(model, "eagle1", seed=2), model, parse_tree("chain:3"))
    tokens, _ = decode(model, Composite([drafter, LookupDrafter(lambda k: 1.0)]), count=24)
    assert tokens == reference(model, count=24), name


@pytest.mark.parametrize("kind, family", [("dflash", "qwen3_next"), ("dspark", "qwen3_next"), ("dspark", "lfm2")])
def test_block_drafters_draft_chains_on_a_hybrid_losslessly(tmp_path, kind, family):
    """DFlash and DSpark block drafters on hybrid targets, a mixture of experts among them
    (Qwen3-Next), and LFM2, whose published DSpark drafters interleave their rotary pairs."""
    import checkpoints
    from mlx_eagle.drafters import dflash, dspark

    model = hybrids.build(family)
    if kind == "dflash":
        checkpoints.write_dflash(tmp_path / kind, model, [0, 1], block=6, mask=3)
        drafter = dflash.DFlashDrafter(dflash.load(tmp_path / kind, model), model, lambda k: 1.0)
    else:
        checkpoints.write_dspark(tmp_path / kind, model, [-1, 1], block=6, mask=3, rope_interleave=family == "lfm2")
        loaded = dspark.load(tmp_path / kind, model)
        assert loaded.config.rope_interleave == (family == "lfm2")
        drafter = dspark.DSparkDrafter(loaded, model, lambda k: 1.0)
    tokens, decoder = decode(model, Composite([drafter, LookupDrafter(lambda k: 1.0)]), count=30)
    assert tokens == reference(model, count=30)


def test_a_published_eagle3_head_converts_for_a_hybrid_and_the_command_drafts_with_it(tmp_path):
    """An EAGLE-3 head in the official layout, for a Qwen3.5 directory (a multimodal wrapper
    whose text model is hybrid): converted against it, and `generate` drafts with it as
    chains, the text that of plain decoding."""

    import numpy as np

    from checkpoints import DRAFT_VOCAB, HEAD, official_tensors, write_checkpoint
    from mlx_eagle.convert.head import convert_head

    directory = write_directory(tmp_path, "qwen3_5")
    embed = np.array(mx.load(str(directory / "model.safetensors"))["language_model.model.embed_tokens.weight"])
    config = dict(HEAD, vocab_size=embed.shape[0], draft_vocab_size=DRAFT_VOCAB, target_hidden_size=64,
                  architectures=["LlamaForCausalLMEagle3"])
    write_checkpoint(tmp_path / "published", official_tensors("eagle3", embed, np.random.default_rng(0)), config,
                     "safetensors")
    head = convert_head(str(tmp_path / "published"), tmp_path / "head", target=str(directory))

    def run(*args):
        return run_generate("--model", str(directory), "--prompt",
                               "The quick brown fox. The quick brown fox. The quick", "--max-tokens", "24",
                               "--verbose", *args)

    drafted, plain = run("--draft", str(head), "--tree", "static:default"), run("--draft", "none")
    assert drafted.returncode == 0 and plain.returncode == 0, drafted.stderr[-2000:] + plain.stderr[-2000:]
    assert "drafts: eagle3 head, tree chain:5 (of static:default" in drafted.stderr, drafted.stderr[-2000:]
    assert drafted.stdout == plain.stdout


def write_llama_cpp_gguf(path, family: str, arch, model, tokenizer, metadata,
                         rewrite=lambda name, value: [(name, value)]):
    """``model`` as llama.cpp's convert_hf_to_gguf writes its family: its Hugging Face
    tensors (MLX's conv kernels [C, L, 1] are Hugging Face's [C, 1, L]) under gguf's own
    names, as ``rewrite(name, value)`` changes them, with ``metadata(writer)``."""
    import gguf
    import numpy as np
    from mlx.utils import tree_flatten

    import synthetic

    layers = len(model.layers)
    names = gguf.TensorNameMap(arch, layers)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_vocab_size(tokenizer.get_vocab_size())
    metadata(writer)  # (with the block count)
    synthetic.add_bpe_tokenizer(writer, tokenizer, "qwen2")
    for ours, array in tree_flatten(model.parameters()):
        for name, value in rewrite(ours.removeprefix("language_model."), np.array(array)):
            base, _, kind = name.rpartition(".")
            if kind not in ("weight", "bias"):  # a parameter that is its own tensor (Mamba's A_log, D)
                base, kind = name, ""
            gguf_name = base if base.startswith("blk.") else names.get_name(base)  # (already llama.cpp's)
            writer.add_tensor(gguf_name + (f".{kind}" if kind else ""), value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def converts_to_the_same_model(tmp_path, family: str, arch, metadata, rewrite):
    """The GGUF of a tiny ``family`` model converts to a model whose logits are its own, and
    that drafts losslessly with lookup."""
    import synthetic
    from mlx_eagle import load
    from mlx_eagle.convert.target import convert_target

    tokenizer = synthetic._bpe_tokenizer("qwen2")
    model = hybrids.build(family, vocab_size=tokenizer.get_vocab_size())
    path = tmp_path / f"{family}.gguf"
    write_llama_cpp_gguf(path, family, arch, model, tokenizer, metadata, rewrite)
    converted, _ = load(str(convert_target(path, tmp_path / "converted", progress=False)))
    tokens = mx.array([PROMPT])
    assert mx.allclose(converted(tokens), model(tokens), atol=1e-4)
    decoded, _ = decode(converted, LookupDrafter(lambda k: 1.0))
    assert decoded == reference(model)


def test_an_lfm2_gguf_converts_to_the_same_model(tmp_path):
    """LFM2 written as llama.cpp's convert_hf_to_gguf writes it (gguf's own tensor names,
    the conv kernels squeezed to 2-D, key/value heads per layer with 0 for the convolution
    layers)."""
    import gguf

    config = hybrids.FAMILIES["lfm2"]

    def metadata(writer):
        writer.add_block_count(config["num_hidden_layers"])
        writer.add_context_length(config["max_position_embeddings"])
        writer.add_embedding_length(config["hidden_size"])
        writer.add_feed_forward_length(config["block_ff_dim"])
        writer.add_head_count(config["num_attention_heads"])
        writer.add_head_count_kv([config["num_key_value_heads"] if kind == "full_attention" else 0
                                  for kind in config["layer_types"]])
        writer.add_rope_freq_base(config["rope_theta"])
        writer.add_layer_norm_rms_eps(config["norm_eps"])
        writer.add_shortconv_l_cache(config["conv_L_cache"])

    def rewrite(name, value):
        return [(name, value[..., 0] if name.endswith("conv.conv.weight") else value)]  # squeezed

    converts_to_the_same_model(tmp_path, "lfm2", gguf.MODEL_ARCH.LFM2, metadata, rewrite)


def mamba2_rewrite(name, value, groups: int, heads: int = 0, kv_heads: int = 0):
    """What llama.cpp's Mamba2Model does to a Mamba-2 block (A written as -exp(A_log), A
    and D as columns, the gated norm per group, conv kernels squeezed, dt_bias renamed),
    and for Nemotron-H's attention, LlamaModel's Q/K row permutation."""
    import numpy as np

    if name.endswith("A_log"):
        return [(name, -np.exp(value).reshape(-1, 1))]
    if name.endswith((".mixer.D", ".mamba.D")):
        return [(name, value.reshape(-1, 1))]
    if name.endswith((".mixer.norm.weight", ".mamba.norm.weight")):
        return [(name, value.reshape(groups, -1))]
    if name.endswith("conv1d.weight"):
        return [(name, value[..., 0])]
    if name.endswith("dt_bias"):
        return [(name.replace("dt_bias", "dt_proj.bias"), value)]
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        count = heads if "q_proj" in name else kv_heads
        permuted = value.reshape(count, 2, value.shape[0] // count // 2, *value.shape[1:]).swapaxes(1, 2)
        return [(name, permuted.reshape(value.shape))]
    return [(name, value)]


def mamba2_metadata(writer, config, heads: int, head_dim: int, state: int, conv: int, groups: int, eps: float):
    writer.add_block_count(config.get("num_hidden_layers") or len(config["hybrid_override_pattern"]))
    writer.add_context_length(2 ** 20)
    writer.add_embedding_length(config["hidden_size"])
    writer.add_ssm_conv_kernel(conv)
    writer.add_ssm_inner_size(heads * head_dim)
    writer.add_ssm_state_size(state)
    writer.add_ssm_time_step_rank(heads)
    writer.add_ssm_group_count(groups)
    writer.add_layer_norm_rms_eps(eps)


def test_a_mamba2_gguf_converts_to_the_same_model(tmp_path):
    import gguf

    config = hybrids.FAMILIES["mamba2"]

    def metadata(writer):
        writer.add_feed_forward_length(0)
        writer.add_head_count(0)
        mamba2_metadata(writer, config, config["num_heads"], config["head_dim"], config["state_size"],
                        config["conv_kernel"], config["n_groups"], config["layer_norm_epsilon"])

    converts_to_the_same_model(tmp_path, "mamba2", gguf.MODEL_ARCH.MAMBA2, metadata,
                               lambda name, value: mamba2_rewrite(name, value, config["n_groups"]))


def test_a_nemotron_h_gguf_converts_to_the_same_model(tmp_path):
    """Nemotron-H: which layers attend (key/value heads per layer) and which are MLPs
    (feed-forward width per layer) written per layer; the rest are Mamba 2."""
    import gguf

    config = hybrids.FAMILIES["nemotron_h"]
    pattern = config["hybrid_override_pattern"]

    def metadata(writer):
        writer.add_head_count(config["num_attention_heads"])
        writer.add_head_count_kv([config["num_key_value_heads"] if kind == "*" else 0 for kind in pattern])
        writer.add_feed_forward_length([config["intermediate_size"] if kind == "-" else 0 for kind in pattern])
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
        mamba2_metadata(writer, config, config["mamba_num_heads"], config["mamba_head_dim"], config["ssm_state_size"],
                        config["conv_kernel"], config["n_groups"], config["layer_norm_epsilon"])

    converts_to_the_same_model(tmp_path, "nemotron_h", gguf.MODEL_ARCH.NEMOTRON_H, metadata, lambda name, value: (
        mamba2_rewrite(name, value, config["n_groups"], config["num_attention_heads"], config["num_key_value_heads"])))


def test_a_granite_hybrid_gguf_converts_to_the_same_model(tmp_path):
    """Granite 4 hybrids: which layers attend written per layer, Granite's multipliers under
    llama.cpp's names, RoPE where rope.scaling.finetuned says so, Q/K permuted as for llama."""
    import gguf

    config = hybrids.FAMILIES["granitemoehybrid"]
    kinds = config["layer_types"]

    def metadata(writer):
        writer.add_feed_forward_length(config["intermediate_size"])
        writer.add_head_count(config["num_attention_heads"])
        writer.add_head_count_kv([config["num_key_value_heads"] if kind == "attention" else 0 for kind in kinds])
        writer.add_rope_freq_base(10000.0)
        writer.add_rope_scaling_finetuned(True)
        writer.add_attention_scale(config["attention_multiplier"])
        writer.add_embedding_scale(config["embedding_multiplier"])
        writer.add_residual_scale(config["residual_multiplier"])
        writer.add_logit_scale(config["logits_scaling"])
        mamba2_metadata(writer, config, config["mamba_n_heads"], config["mamba_d_head"], config["mamba_d_state"],
                        config["mamba_d_conv"], config["mamba_n_groups"], config["rms_norm_eps"])

    converts_to_the_same_model(tmp_path, "granitemoehybrid", gguf.MODEL_ARCH.GRANITE_HYBRID, metadata,
                               lambda name, value: mamba2_rewrite(name, value, config["mamba_n_groups"],
                                                                  config["num_attention_heads"],
                                                                  config["num_key_value_heads"]))


def test_a_qwen3_5_gguf_converts_to_the_same_model(tmp_path):
    """Qwen3.5 as llama.cpp's Qwen3.5 converter writes it: A as -exp(A_log), dt_bias
    renamed, conv kernels squeezed, norms as the (1 + w) they apply, and the value heads
    tiled across key heads (this model has 4 value heads to 2 key heads); and a multi-token
    prediction layer past the model's own, which the conversion leaves out."""
    import gguf
    import numpy as np

    config = hybrids.FAMILIES["qwen3_5"]["text_config"]
    key_heads, value_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    value_dim, key_part = config["linear_value_head_dim"], 2 * key_heads * config["linear_key_head_dim"]

    def metadata(writer):
        writer.add_block_count(config["num_hidden_layers"] + 1)
        writer.add_nextn_predict_layers(1)
        writer.add_context_length(config["max_position_embeddings"])
        writer.add_embedding_length(config["hidden_size"])
        writer.add_feed_forward_length(config["intermediate_size"])
        writer.add_head_count(config["num_attention_heads"])
        writer.add_head_count_kv(config["num_key_value_heads"])
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
        writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
        rope = config["rope_parameters"]
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_rope_dimension_count(int(config["head_dim"] * rope["partial_rotary_factor"]))
        writer.add_rope_dimension_sections(rope["mrope_section"] + [0])
        writer.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
        writer.add_ssm_state_size(config["linear_key_head_dim"])
        writer.add_ssm_group_count(key_heads)
        writer.add_ssm_time_step_rank(value_heads)
        writer.add_ssm_inner_size(value_dim * value_heads)
        writer.add_full_attention_interval(config["full_attention_interval"])

    def tiled(value, axis, start, head_dim):  # llama.cpp's _reorder_v_heads
        moved = np.moveaxis(value, axis, 0)
        tail = moved[start:].reshape(key_heads, value_heads // key_heads, head_dim, *moved.shape[1:])
        moved = np.concatenate([moved[:start], tail.swapaxes(0, 1).reshape(moved[start:].shape)])
        return np.moveaxis(moved, 0, axis)

    def rewrite(name, value):
        if name.endswith("A_log"):
            value = -np.exp(value)
        if name.endswith("conv1d.weight"):
            value = value[..., 0]
        for suffix, (axis, start, head_dim) in {
                "in_proj_qkv.weight": (0, key_part, value_dim), "in_proj_z.weight": (0, 0, value_dim),
                "in_proj_a.weight": (0, 0, 1), "in_proj_b.weight": (0, 0, 1), "A_log": (0, 0, 1),
                "dt_bias": (0, 0, 1), "conv1d.weight": (0, key_part, value_dim),
                "out_proj.weight": (1, 0, value_dim)}.items():
            if name.endswith(f"linear_attn.{suffix}"):
                value = tiled(value, axis, start, head_dim)
        if name.endswith("dt_bias"):
            name = name.replace("dt_bias", "dt_proj.bias")
        rows = [(name, value)]
        if name == "model.norm.weight":  # the MTP layer llama.cpp appends as one more block
            rows.append((f"blk.{config['num_hidden_layers']}.nextn.eh_proj.weight",
                         np.zeros((config["hidden_size"], 2 * config["hidden_size"]), dtype=np.float32)))
        return rows

    converts_to_the_same_model(tmp_path, "qwen3_5", gguf.MODEL_ARCH.QWEN35, metadata, rewrite)
