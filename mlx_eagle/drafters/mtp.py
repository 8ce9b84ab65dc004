"""The multi-token-prediction (MTP) module a model ships, as its own drafter: Qwen3-Next,
Qwen3.5 and Qwen3.6 carry one (``mtp.*`` beside the model's weights), which mlx-lm's
``sanitize`` drops. It is read from the model's own checkpoint files.

One step, as vLLM's qwen3_next_mtp runs it: fc(concat[pre_fc_norm_embedding(embed(x_t+1)),
pre_fc_norm_hidden(h_t)]) through one full-attention decoder layer of the model's own kind
(a mixture of experts where the model's layers are), then ``mtp.norm``; the target's LM
head reads the result. The order is [embedding, hidden] (reversed, its drafts agree with
almost nothing: mlx-lm #1469), and h_t is the state leaving the target's final norm, as
vLLM and llama.cpp (#24025) feed it. Deeper drafts feed the module its own output, so it
drafts like an EAGLE-1 head: this module gives it the ``Head`` interface and EagleDrafter
grows its chains (the hybrid models it ships with verify chains only), its KV cache holding
the committed positions and cut back each round. Raw Hugging Face checkpoints store the
norms as offsets from 1 and the experts one by one; both are brought to mlx-lm's layout.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..errors import UserError
from ..target import Mask, Positions, compute_dtype, embedding_layer, inner_model, lm_head
from . import DraftSettings, DraftSource

NAME = "mtp"
# What peers measure for Qwen's MTP modules (mlx-vlm #2040: 3.72 tokens a round at depth 4),
# as a table by (depth, rank) for --tree auto until tune measures this device's: rank 0
# only, since the module is asked for chains.
PUBLISHED_ACCEPTANCE = np.array([[0.9, 0.0], [0.85, 0.0], [0.8, 0.0], [0.75, 0.0], [0.7, 0.0]])
_NORMS = ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "mtp.norm.weight", "input_layernorm.weight",
          "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight")
MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


MTP_KEY = re.compile(r"^(model\.|language_model\.)*mtp\.")  # where checkpoints keep the module


def is_raw(weights: Dict[str, mx.array]) -> bool:
    """A Hugging Face checkpoint as published (not mlx-lm's layout): its convolution
    kernels are [channels, 1, width]."""
    return any("conv1d.weight" in k and v.shape[-1] != 1 for k, v in weights.items())


def sanitize_mtp(weights: Dict[str, mx.array], raw: bool) -> Dict[str, mx.array]:
    """The ``mtp.*`` tensors of a checkpoint's ``weights``, in mlx-lm's layout: experts
    stacked, and, from a ``raw`` checkpoint, norms as weights rather than offsets from 1."""
    found = {"mtp." + key.split("mtp.", 1)[1]: value for key, value in weights.items()
             if MTP_KEY.match(key)}
    experts: Dict[str, Dict[int, mx.array]] = {}
    out = {}
    for key, value in found.items():
        expert = re.match(r"(.*\.mlp)\.experts\.(\d+)\.(\w+_proj)\.weight$", key)
        if expert:
            stacked = f"{expert.group(1)}.switch_mlp.{expert.group(3)}.weight"
            experts.setdefault(stacked, {})[int(expert.group(2))] = value
            continue
        out[key] = value + 1.0 if raw and value.ndim == 1 and key.endswith(_NORMS) else value
    for key, parts in experts.items():
        out[key] = mx.stack([parts[e] for e in sorted(parts)])
    return out


class MTPModule(nn.Module):
    """A model's MTP module with the Head interface (heads.py): EagleDrafter drafts with it."""

    family = "mtp"

    def __init__(self, target: nn.Module, layer: nn.Module):
        super().__init__()
        hidden, eps = target.args.hidden_size, target.args.rms_norm_eps
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden, eps=eps)
        self.layers = [layer]
        self.norm = nn.RMSNorm(hidden, eps=eps)
        self.acceptance = PUBLISHED_ACCEPTANCE

    def taps(self, num_target_layers: int) -> None:
        return None  # the post-norm last state

    def project(self, features: mx.array) -> mx.array:
        return features

    def step(self, target: nn.Module, hidden: mx.array, tokens: mx.array, cache: List, positions: Positions,
             mask: Mask) -> mx.array:
        """The module over (hidden state t, token t + 1) pairs at the cache's next positions
        (chains: ``positions`` is where the cache ends)."""
        embedding = embedding_layer(target)(tokens)
        x = self.fc(mx.concatenate([self.pre_fc_norm_embedding(embedding),
                                    self.pre_fc_norm_hidden(hidden.astype(embedding.dtype))], axis=-1))
        return self.norm(self.layers[0](x, mask=mask, cache=cache[0]))

    def logits(self, target: nn.Module, hidden: mx.array) -> mx.array:
        return lm_head(target, hidden)

    def target_ids(self, draft_ids: mx.array) -> mx.array:
        return draft_ids


def module_for(model: nn.Module, weights: Dict[str, mx.array], source) -> Optional[MTPModule]:
    """The MTP module held in a checkpoint's ``weights`` for ``model`` (None: it holds none),
    or one line when its MTP tensors are partial or of another shape."""
    from mlx_lm.utils import dequantize_model

    tensors = sanitize_mtp(weights, is_raw(weights))
    if not tensors:
        return None
    if getattr(model.args, "model_type", None) not in MODEL_TYPES:
        raise UserError(f"{source} holds MTP tensors for a {model.args.model_type!r} model, whose MTP layout is not "
                        f"known here (known: {', '.join(MODEL_TYPES)}); pass --draft lookup or none")
    layers = inner_model(model).layers
    index = next(i for i, layer in enumerate(layers) if not getattr(layer, "is_linear", False))
    module = MTPModule(model, type(layers[index])(model.args, index))  # a full-attention layer of its kind
    if any(name.endswith(".scales") for name in tensors):
        nn.quantize(module, class_predicate=lambda path, m: f"mtp.{path}.scales" in tensors)
    wanted = {f"mtp.{name}": value.shape for name, value in tree_flatten(module.parameters())}
    missing, extra = sorted(set(wanted) - set(tensors)), sorted(set(tensors) - set(wanted))
    shapes = sorted(n for n in set(wanted) & set(tensors) if tuple(tensors[n].shape) != tuple(wanted[n]))
    if missing or extra or shapes:
        problem = ", ".join(f"{len(names)} {what} (e.g. {names[0]})" for names, what in
                            ((missing, "missing"), (extra, "unexpected"), (shapes, "of another shape")) if names)
        raise UserError(f"{source}: its MTP tensors are not a whole module for this model: {problem}; pass --draft "
                        "lookup or none")
    module.load_weights([(name[len("mtp."):], value) for name, value in tensors.items()], strict=True)
    if mx.default_device() == mx.cpu:
        module = dequantize_model(module)
    module.set_dtype(compute_dtype(model), predicate=lambda dtype: mx.issubdtype(dtype, mx.floating))
    mx.eval(module.parameters())
    return module


def recognizes(path: Path, config: Optional[dict]) -> bool:
    return False  # it comes with the model, never as --draft


def load(directory: Path, model: nn.Module):
    raise UserError(f"{directory}: an MTP module is read from the model's own checkpoint; pass --draft auto")


def accepts(draft: object) -> bool:
    return isinstance(draft, MTPModule)


def shipped(model: nn.Module) -> Optional[MTPModule]:
    """The MTP module in the model's own checkpoint files, if they hold one."""
    directory = getattr(model, "directory", None)
    if directory is None or getattr(model.args, "model_type", None) not in MODEL_TYPES:
        return None
    from ..heads import read_safetensors

    module = module_for(model, read_safetensors(directory), directory)
    if module is not None:
        module.directory = Path(directory)
    return module


def source(draft: MTPModule, model: nn.Module, settings: DraftSettings) -> DraftSource:
    """The module drafting chains, as an EAGLE head does (eagle.source), named for what it is."""
    from . import eagle

    made = eagle.source(draft, model, settings)
    return DraftSource(made.name.replace("mtp head", "the model's MTP module"), made.make, made.note, draft)
