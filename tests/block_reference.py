"""An independent reference, in numpy, of block drafters' published forward pass (DFlash's
backbone, which DSpark shares)."""

import numpy as np


def rms(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x, positions, theta=10000.0, interleaved=False):
    """x [n, heads, dim] rotated at ``positions``: rotate-half, as Qwen3 and Llama, or with
    each adjacent pair rotated (``interleaved``, GPT-J style)."""
    half = x.shape[-1] // 2
    angles = positions[:, None] * theta ** (-np.arange(half) / half)
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:])
    y1, y2 = x1 * cos - x2 * sin, x1 * sin + x2 * cos
    return np.stack([y1, y2], axis=-1).reshape(x.shape) if interleaved else np.concatenate([y1, y2], axis=-1)


def reference_block_states(t, config, states, block_tokens, embed):
    """The final normed states of a block drafter's block [root, mask, ...] after the context ``states``."""
    heads, kv, dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    context = rms(states @ t["fc.weight"].T, t["hidden_norm.weight"])
    n, length = len(context), len(block_tokens)
    h = embed[block_tokens]
    block_positions, context_positions = np.arange(n, n + length), np.arange(n)
    interleaved = config.get("rope_interleave", False)
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        x = rms(h, t[p + "input_layernorm.weight"])

        def keys_values(source, positions, p=p):
            keys = rms((source @ t[p + "self_attn.k_proj.weight"].T).reshape(len(source), kv, dim),
                       t[p + "self_attn.k_norm.weight"])
            values = (source @ t[p + "self_attn.v_proj.weight"].T).reshape(len(source), kv, dim)
            return rope(keys, positions, interleaved=interleaved), values

        q = rope(rms((x @ t[p + "self_attn.q_proj.weight"].T).reshape(length, heads, dim),
                     t[p + "self_attn.q_norm.weight"]), block_positions, interleaved=interleaved)
        (kc, vc), (kb, vb) = keys_values(context, context_positions), keys_values(x, block_positions)
        keys = np.repeat(np.concatenate([kc, kb]), heads // kv, axis=1)
        values = np.repeat(np.concatenate([vc, vb]), heads // kv, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, keys) / np.sqrt(dim)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        out = np.einsum("hqk,khd->qhd", weights, values).reshape(length, heads * dim)
        h = h + out @ t[p + "self_attn.o_proj.weight"].T
        x = rms(h, t[p + "post_attention_layernorm.weight"])
        gate = x @ t[p + "mlp.gate_proj.weight"].T
        h = h + ((gate / (1 + np.exp(-gate))) * (x @ t[p + "mlp.up_proj.weight"].T)) @ t[p + "mlp.down_proj.weight"].T
    return rms(h, t["norm.weight"])
