"""DFlash block drafters (drafters/dflash.py): checkpoints written in the z-lab layout load,
and the block's logits equal an independent numpy reference of the published forward
pass (context keys cached across rounds); greedy decoding with a random drafter equals
plain mlx-lm on tiny models and on the real SmolLM2, on chains and on DDTree trees,
merged with lookup; bad checkpoints get one line. (Sampling: tests/test_sampling.py.)"""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from mlx_eagle.drafters.composite import Composite
from mlx_eagle.drafters.dflash import DFlashDrafter, load
from mlx_eagle.drafters.lookup import LookupDrafter
from mlx_eagle.errors import UserError
from mlx_eagle.target import lm_head
from commands import run_generate
from drafting import decode
from plain import plain_tokens
from checkpoints import refused_in_one_line, tiny_target, write_dflash
from block_reference import reference_block_states

PROMPT = [5, 17, 33, 5, 17, 60, 2, 9, 41, 17, 5, 17, 33]


def test_the_block_logits_equal_the_numpy_reference(tmp_path):
    """Context read in two rounds (its keys cached), then a block: as one reference pass."""
    target = tiny_target()
    config, tensors = write_dflash(tmp_path / "dflash", target, [1, 3])
    drafter = load(tmp_path / "dflash", target)
    rng = np.random.default_rng(1)
    states = rng.standard_normal((9, 2 * 64)).astype(np.float32)
    block = [41] + [3] * 7
    cache = [KVCache() for _ in drafter.layers]
    drafter.read_context(mx.array(states[:6]), cache, 0)
    drafter.read_context(mx.array(states[6:]), cache, 6)
    got = np.array(lm_head(target, drafter.blocks_states(target, [(block[0], cache, 9)])[0][1:]))
    final = reference_block_states(tensors, config, states, block, np.array(target.model.embed_tokens.weight))
    expected = final[1:] @ np.array(target.lm_head.weight).T
    assert got.shape == (7, 97)
    assert np.abs(got - expected).max() < 1e-4 * max(1.0, np.abs(expected).max())
    assert drafter.config.taps == (2, 4)  # layer i's output is the state entering layer i + 1


@pytest.mark.parametrize("curve", ["flat: deep chains and wide trees", "steep: short chains"])
@pytest.mark.parametrize("lookup", [False, True])
def test_greedy_decoding_with_a_random_drafter_equals_mlx_lm(tmp_path, curve, lookup):
    target = tiny_target()
    write_dflash(tmp_path / "dflash", target, [1, 3])
    cost = (lambda k: 1.0) if curve.startswith("flat") else (lambda k: 1.0 + 0.1 * (k - 1))
    drafter = DFlashDrafter(load(tmp_path / "dflash", target), target, cost)
    trees = []
    propose = drafter.propose
    drafter.propose = lambda budget: trees.append(propose(budget)) or trees[-1]
    merged = Composite([drafter, LookupDrafter(lambda k: 1.0)]) if lookup else drafter
    tokens, decoder = decode(target, merged, PROMPT, 40)
    assert tokens == plain_tokens(target, PROMPT, 40)
    drafted = [t for t in trees if t is not None]
    assert drafted, "the drafter proposed"
    if curve.startswith("flat"):
        assert any(not t.tree.is_chain() for t in drafted), "DDTree branches stood beside the chain"


def test_smollm2_decodes_losslessly_with_a_random_drafter(smollm, tmp_path):
    """The real model with a random DFlash drafter reading three of its layers, as a chain
    and as a tree, merged with lookup: the text of plain decoding."""
    model, tokenizer = smollm
    sizes = {"num_hidden_layers": 1, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
             "intermediate_size": 256}
    write_dflash(tmp_path / "dflash", model, [1, 14, 26], block=16, mask=0, sizes=sizes)
    drafter = load(tmp_path / "dflash", model)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Repeat: the cat sat on the mat. The cat sat"}],
                                        add_generation_prompt=True)
    expected = plain_tokens(model, ids, 32)
    for cost in (lambda k: 1.0, lambda k: 1.0 + 0.05 * (k - 1)):
        merged = Composite([DFlashDrafter(drafter, model, cost), LookupDrafter(lambda k: 1.0)])
        tokens, _ = decode(model, merged, ids, 32)
        assert tokens == expected[:len(tokens)]


def test_the_command_drafts_with_a_dflash_directory_and_says_so(smollm, tmp_path):
    model, _ = smollm
    sizes = {"num_hidden_layers": 1, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
             "intermediate_size": 256}
    write_dflash(tmp_path / "dflash", model, [1, 14, 26], block=16, mask=0, sizes=sizes)

    def run(*args):
        return run_generate("--prompt", "Count: 1, 2, 3, 4,",
                               "--max-tokens", "16", "--verbose", *args)

    drafted, plain = run("--draft", str(tmp_path / "dflash")), run("--draft", "none")
    assert drafted.returncode == 0, drafted.stderr[-2000:]
    assert "drafts: dflash dflash, block 16 + context lookup" in drafted.stderr, drafted.stderr[-1500:]
    assert drafted.stdout == plain.stdout


BAD = [
    ({"dflash_config": None}, "no dflash_config"),
    ({"dflash_config": {"mask_token_id": 3, "target_layer_ids": [1, 9]}}, r"target_layer_ids \[9\] not below"),
    ({"dflash_config": {"mask_token_id": 500, "target_layer_ids": [1, 3]}}, "mask token 500 outside"),
    ({"dflash_config": {"mask_token_id": 3, "target_layer_ids": "1,3"}}, "must be a list of layer numbers"),
    ({"vocab_size": 50}, "vocabulary 50 vs the target's 97"),
    ({"hidden_size": 32}, "hidden size 32 vs the target's 64"),
    ({"conv_kernel_size": 4, "architectures": ["DFlash2DraftModel"]}, "DFlash2 checkpoint .* not supported"),
    ({"layer_types": ["full_attention", "linear"]}, "layer_types must name"),
    ({"num_hidden_layers": 3}, r"weights do not match its config.json: 11 missing \(e.g. layers.2"),
]


@pytest.mark.parametrize("change, message", BAD, ids=[m for _, m in BAD])
def test_a_bad_checkpoint_gets_one_line(tmp_path, change, message):
    target = tiny_target()
    directory = tmp_path / "dflash"
    config, tensors = write_dflash(directory, target, [1, 3])
    config.update(change)
    if config.get("dflash_config") is None:
        config.pop("dflash_config")
    refused_in_one_line(load, directory, target, config, message)


def test_the_converter_checks_casts_and_quantizes_a_dflash_checkpoint(smollm, tmp_path):
    from mlx_eagle.convert.head import convert_head

    model, _ = smollm
    sizes = {"num_hidden_layers": 1, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
             "intermediate_size": 256}
    write_dflash(tmp_path / "published", model, [1, 14, 26], block=16, mask=0, sizes=sizes)
    quantized = convert_head(str(tmp_path / "published"), tmp_path / "q8", q_bits=8)
    assert json.loads((quantized / "config.json").read_text())["quantization"] == {"group_size": 64, "bits": 8}
    assert "layers.0.mlp.up_proj.scales" in mx.load(str(quantized / "model.safetensors"))
    rng = np.random.default_rng(0)
    states = mx.array(rng.standard_normal((6, 3 * 576)).astype(np.float32))
    logits = []
    for directory in (tmp_path / "published", quantized):
        drafter = load(directory, model)
        cache = [KVCache() for _ in drafter.layers]
        drafter.read_context(states, cache, 0)
        logits.append(np.array(lm_head(model, drafter.blocks_states(model, [(42, cache, 6)])[0][1:])))
    assert np.abs(logits[0] - logits[1]).max() < 0.05 * np.abs(logits[0]).max()
    with pytest.raises(UserError, match="vocabulary 97 vs the target's 49152"):
        write_dflash(tmp_path / "other", tiny_target(), [1, 3])
        convert_head(str(tmp_path / "other"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_tree_setting_shapes_what_a_dflash_drafter_proposes(tmp_path):
    from mlx_eagle.drafters.kinds import DraftSettings
    from mlx_eagle.drafters.dflash import source

    target = tiny_target()
    write_dflash(tmp_path / "dflash", target, [1, 3])
    drafter = load(tmp_path / "dflash", target)
    assert source(drafter, target, DraftSettings(target, "none")).make is None
    chains = source(drafter, target, DraftSettings(target, "chain:3"))
    assert chains.name.endswith("chains of up to 3")
    made = chains.make()
    assert made.max_tokens == 3 and not made.trees
    assert source(drafter, target, DraftSettings(target, "auto")).make().trees
