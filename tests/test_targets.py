"""Every architecture on the tree path (llama with Llama 3's RoPE scaling, mistral, qwen2, mimo,
qwen3, and the mixtures of experts qwen3_moe, mixtral, gpt_oss with its attention sinks,
sliding-window layers and YaRN RoPE, glm4_moe, and deepseek_v3 and glm4_moe_lite with
multi-head latent attention), as tiny models with random weights: a tree's logits
equal mlx-lm's own forward pass over each branch, and greedy decoding with a random head,
an oracle head or context drafts alone gives exactly mlx-lm's greedy tokens, also once
the context is longer than gpt-oss's window."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from drafting import decoder as make_decoder
from mlx_eagle.heads import new_head
from mlx_eagle.drafters.lookup import LookupDrafter
from mlx_eagle.compiled import compiles_verification, verify_block
from mlx_eagle.target import make_cache, target_forward, tree_mask
from mlx_eagle.verify import Sampling
from oracle import OracleHead
from synthetic import ARCHS, MOE_CONFIGS, build_model, moe_config, target_config
from plain import plain_tokens

PROMPT = [5, 17, 99, 3, 250, 41, 41, 7, 300, 12, 8, 77, 5, 17, 99, 3, 120, 64, 9, 200]  # longer than gpt-oss's window


@pytest.fixture(scope="module", params=[a for a in ARCHS if a != "llama"] + list(MOE_CONFIGS)
                + ["mimo", "glm4_moe", "deepseek_v3", "glm4_moe_lite"])
def tree_target(request):
    return request.param, build_model(target_config(request.param))


def mlx_lm_logits(model, tokens):
    """mlx-lm's own forward over ``tokens`` (its own caches: rotating ones for sliding layers)."""
    return model(mx.array([tokens]), cache=make_prompt_cache(model))[0]


def test_tree_logits_equal_mlx_lms_forward_over_each_branch(tree_target):
    _, model = tree_target
    cache = make_cache(model)
    prefill = target_forward(model, mx.array([PROMPT]), cache, 0, "causal")
    assert np.abs(np.array(prefill.logits[0]) - np.array(mlx_lm_logits(model, PROMPT))).max() < 1e-4
    # Root, a branch of three, a branch of two: [r, a1, a2, a3, b1, b2].
    tokens = [11, 21, 22, 23, 31, 32]
    parents = [-1, 0, 1, 2, 0, 4]
    depths = [0, 1, 2, 3, 1, 2]
    ancestors = np.eye(6, dtype=bool)
    for node in range(6):
        parent = parents[node]
        while parent >= 0:
            ancestors[node, parent] = True
            parent = parents[parent]
    start = len(PROMPT)
    tree = target_forward(model, mx.array([tokens]), cache, start + mx.array(depths),
                          tree_mask(start, mx.array(ancestors)))
    got = np.array(tree.logits[0])
    for branch in ([0, 1, 2, 3], [0, 4, 5]):
        expected = np.array(mlx_lm_logits(model, PROMPT + [tokens[n] for n in branch]))[-len(branch):]
        assert np.abs(got[branch] - expected).max() < 1e-4


@pytest.mark.parametrize("block", ["tree", "chain"])
def test_a_compiled_verification_equals_target_forward(tree_target, block, compiling):
    """A round's block verified in one compiled call (padded to a bucket, the caches'
    buffers read whole and written in place, stale entries past the held ones masked
    out) gives target_forward's logits and leaves the same cache entries; architectures
    with latent attention keep target_forward."""
    compiling(True)
    model_type, model = tree_target
    eager, compiled = make_cache(model), make_cache(model)
    for cache in (eager, compiled):
        target_forward(model, mx.array([PROMPT + [1, 2, 3]]), cache, 0, "causal")
        for layer_cache in cache:
            layer_cache.trim(3)  # entries past the held ones, stale
    if not compiles_verification(model, compiled, 7):
        assert model_type in ("deepseek_v3", "glm4_moe_lite")
        return
    # A tree: the root, a branch of three, a branch of three. A chain: the root and six.
    # Seven tokens, padded to a bucket of eight.
    parents = [-1, 0, 1, 2, 0, 4, 5] if block == "tree" else [-1, 0, 1, 2, 3, 4, 5]
    tokens = [11, 21, 22, 23, 31, 32, 33]
    ancestors, depths = np.eye(7, dtype=bool), [0] * 7
    for node in range(7):
        parent = parents[node]
        depths[node] = depths[parent] + 1 if parent >= 0 else 0
        while parent >= 0:
            ancestors[node, parent], parent = True, parents[parent]
    start = len(PROMPT)
    expected = target_forward(model, mx.array([tokens]), eager, start + mx.array(depths),
                              tree_mask(start, mx.array(ancestors)))
    got = verify_block(model, mx.array(tokens), compiled, [start + d for d in depths], ancestors)
    assert np.abs(np.array(got.logits) - np.array(expected.logits[0])).max() < 1e-4
    for ours, theirs in zip(compiled, eager):
        assert ours.offset == theirs.offset == start + 7
        for mine, expected_entries in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
            held = np.array(mine[..., :ours.offset, :]) - np.array(expected_entries[..., :ours.offset, :])
            assert np.abs(held).max() < 1e-4


def mlx_lm_greedy(model, count):
    return plain_tokens(model, PROMPT, count)


def speculative_greedy(model, head, tree, count, lookup=False):
    decoder = make_decoder(model, head, tree, Sampling(),
                           lookup=LookupDrafter(lambda k: 1.0 + 0.05 * k) if lookup else None)
    tokens = [decoder.prefill(PROMPT)]
    while len(tokens) < count:
        tokens += decoder.round(count - len(tokens)).tokens
    return tokens[:count]


@pytest.mark.parametrize("drafts", ["random eagle3 head, static tree", "random eagle1 head, dynamic tree",
                                    "oracle head, static tree", "context lookup alone"])
def test_greedy_decoding_equals_mlx_lm(tree_target, drafts):
    _, model = tree_target
    count = 40
    expected = mlx_lm_greedy(model, count)
    if drafts.startswith("random"):
        head = new_head(model, drafts.split()[1])
    elif drafts.startswith("oracle"):
        head = OracleHead(PROMPT + expected, model.args.vocab_size)
    else:
        head = None
    tree = "dynamic:topk=3,depth=4,tokens=10" if "dynamic" in drafts else "static:default"
    assert speculative_greedy(model, head, tree if head is not None else "none", count,
                              lookup=head is None) == expected


def test_verification_stays_lossless_as_the_caches_grow(monkeypatch, compiling):
    """Compiled verification writes into the caches' buffers in place: a reply that runs
    past their end (mlx-lm grows them 256 entries at a time) has them grown first, and
    its tokens stay mlx-lm's, through rounds with tree and chain blocks of many sizes."""
    from mlx_eagle import decoder as decoding

    compiling(True)
    blocks = []
    monkeypatch.setattr(decoding, "verify_block", lambda model, tokens, *args: blocks.append(tokens.size) or
                        verify_block(model, tokens, *args))
    model = build_model(target_config("qwen3"))
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 380, size=240)]
    expected = plain_tokens(model, prompt, 40)
    decoder = make_decoder(model, new_head(model, "eagle3"), "static:default", Sampling(),
                           lookup=LookupDrafter(lambda k: 1.0 + 0.05 * k))
    tokens = [decoder.prefill(prompt)]
    while len(tokens) < len(expected):
        tokens += decoder.round(len(expected) - len(tokens)).tokens
    assert tokens[:len(expected)] == expected
    assert len(blocks) == decoder.forwards - 1 and len(set(blocks)) > 1  # every round compiled, blocks of many sizes
    assert decoder.target_cache[0].offset > 256 and decoder.target_cache[0].keys.shape[2] > 256  # grown


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_moe_hugging_face_directories_convert(tmp_path, model_type):
    """One tensor per expert, as published, converts to mlx-lm's stacked experts: the same
    logits in float, and with --q-bits the experts are quantized too."""
    import json

    from mlx_lm import load

    from mlx_eagle.convert.target import convert_target
    from synthetic import write_moe_hf

    directory = write_moe_hf(tmp_path, model_type)
    reference = build_model(json.loads((directory / "config.json").read_text()))
    tokens = mx.array([PROMPT])
    model, _ = load(str(convert_target(directory, tmp_path / "float", progress=False)))
    assert mx.array_equal(model(tokens), reference(tokens))
    quantized = convert_target(directory, tmp_path / "q8", q_bits=8, progress=False)
    assert any(k.endswith("switch_mlp.gate_proj.scales") for k in mx.load(str(quantized / "model.safetensors")))
    model, _ = load(str(quantized))  # quantized experts (gather_qmm) inside the compiled verification, still lossless
    assert speculative_greedy(model, new_head(model, "eagle3"), "static:default", 24) == mlx_lm_greedy(model, 24)


def test_a_gpt_oss_hugging_face_checkpoint_says_where_it_runs_instead(tmp_path):
    import json

    from mlx_eagle.convert.target import convert_target
    from mlx_eagle.errors import UserError
    from synthetic import write_moe_hf

    directory = write_moe_hf(tmp_path, "mixtral")
    config = dict(moe_config("gpt_oss"), vocab_size=json.loads((directory / "config.json").read_text())["vocab_size"])
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="MLX conversion of it"):
        convert_target(directory, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_the_generate_command_on_an_moe_model_prints_plain_decodings_text(tmp_path, model_type):
    """As a user runs it: an mlx-lm MoE directory, an EAGLE-3 head for it, `generate`
    with a tree prints exactly what `--draft none` prints."""
    import subprocess
    import sys

    from mlx_lm import load

    from mlx_eagle.heads import save_head
    from synthetic import write_moe_mlx

    directory = write_moe_mlx(tmp_path, model_type)
    save_head(new_head(load(str(directory))[0], "eagle3"), tmp_path / "head")

    def generate(*flags):
        result = subprocess.run([sys.executable, "-m", "mlx_eagle.generate", "--model", str(directory), "--prompt",
                                 "Paris is the capital of", "--max-tokens", "40", *flags],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        return result.stdout

    plain = generate("--draft", "none")
    assert plain.strip()
    assert generate("--draft", str(tmp_path / "head"), "--tree", "static:default") == plain
    assert generate("--draft", "lookup") == plain
