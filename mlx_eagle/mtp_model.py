"""The multi-token-prediction (MTP) module a model ships, as its own drafter: Qwen3-Next,
Qwen3.5 and Qwen3.6 carry one (``mtp.*`` beside the model's weights), MiMo another
(``model.mtp_layers.0.*``); mlx-lm's ``sanitize`` drops both. It is read from the model's
own checkpoint files.

One step, as vLLM's qwen3_next_mtp and mimo_mtp run it: fc(concat[norm(embed(x_t+1)),
norm(h_t)]) through one decoder layer of the model's own kind (a full-attention layer, a
mixture of experts where the model's layers are), then a final norm; the target's LM head
reads the result. Qwen's order is [embedding, hidden] (reversed, its drafts agree with
almost nothing: mlx-lm #1469), MiMo's [hidden, embedding]; h_t is the state leaving the
target's final norm, as vLLM and llama.cpp (#24025) feed it. Deeper drafts feed the module
its own output, so it drafts like an EAGLE-1 head: this module gives it the ``Head``
interface and EagleDrafter grows its chains (trees where target.py drives the target: MiMo,
DeepSeek, GLM; Qwen's hybrids verify chains), its KV cache holding the committed positions and cut back
each round. Every family's tensors are brought to one layout, Qwen's (``mtp.fc``,
``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.layers.0.*``,
``mtp.norm``): raw Qwen checkpoints store the norms as offsets from 1 and the experts one by
one, and MiMo names its parts otherwise. Drafting with it is drafters/mtp.py's.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.utils import dequantize_model

from .errors import UserError
from .target import (Mask, Positions, compute_dtype, decoder_layer, embedding_layer, inner_model, is_driven,
                      layer_count, lm_head)

# What peers measure for Qwen's MTP modules (mlx-vlm #2040: 3.72 tokens a round at depth 4),
# as a table by (depth, rank) for --tree auto until tune measures this device's: rank 0
# only, since the module is asked for chains.
PUBLISHED_ACCEPTANCE = np.array([[0.9, 0.0], [0.85, 0.0], [0.8, 0.0], [0.75, 0.0], [0.7, 0.0]])
_NORMS = ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "mtp.norm.weight", "input_layernorm.weight",
          "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight")


@dataclass(frozen=True)
class Layout:
    """Where a family's checkpoints keep its MTP module and what they call its parts.
    ``key``: its tensors' names (group ``name``: the name within the module; ``index``: the
    module's, where there are several, counted from the model's layer count where
    ``after_layers``: the first module drafts, at every depth); ``renamed``: their names for
    the parts around the decoder layer -> Qwen's (None: not read, the target's own are used);
    ``layer``: where the decoder layer's own tensors are within the module;
    ``hidden_first``: the concatenation's order; ``delta_norms``: raw checkpoints store norms
    as offsets from 1; ``model_sanitizes``: the decoder layer's tensors go through the
    model's own sanitize (DeepSeek's attention and experts); ``zero_first``: the embedding
    at position 0 is zeroed, as DeepSeek's module reads it."""

    key: re.Pattern
    renamed: Tuple[Tuple[str, Optional[str]], ...] = ()
    layer: str = ""
    hidden_first: bool = False
    delta_norms: bool = False
    after_layers: bool = False
    model_sanitizes: bool = False
    zero_first: bool = False


QWEN = Layout(re.compile(r"^(?:model\.|language_model\.)*mtp\.(?P<name>.*)"), delta_norms=True)
MIMO = Layout(re.compile(r"^model\.mtp_layers\.(?P<index>\d+)\.(?P<name>.*)"),
              (("input_proj.", "fc."), ("token_layernorm.", "pre_fc_norm_embedding."),
               ("hidden_layernorm.", "pre_fc_norm_hidden."), ("final_layernorm.", "norm.")),
              layer="layers.0.", hidden_first=True)
# DeepSeek-V3 and GLM-4.5: model.layers.{num_hidden_layers + i}, with copies of the model's
# embedding and LM head (not read: the model's own are the same tensors).
DEEPSEEK = Layout(re.compile(r"^model\.layers\.(?P<index>\d+)\.(?P<name>.*)"),
                  (("eh_proj.", "fc."), ("enorm.", "pre_fc_norm_embedding."), ("hnorm.", "pre_fc_norm_hidden."),
                   ("shared_head.norm.", "norm."), ("shared_head.head.", None), ("embed_tokens.", None)),
                  layer="layers.0.", after_layers=True, model_sanitizes=True, zero_first=True)
LAYOUTS = {"qwen3_next": QWEN, "qwen3_5_text": QWEN, "qwen3_5_moe_text": QWEN, "mimo": MIMO,
           "deepseek_v3": DEEPSEEK, "glm4_moe": DEEPSEEK, "glm4_moe_lite": DEEPSEEK}
MODEL_TYPES = tuple(LAYOUTS)


def is_raw(weights: Dict[str, mx.array]) -> bool:
    """A Hugging Face checkpoint as published (not mlx-lm's layout): its convolution
    kernels are [channels, 1, width]."""
    return any("conv1d.weight" in k and v.shape[-1] != 1 for k, v in weights.items())


def _matched(layout: Layout, key: str, layers: int) -> Optional[str]:
    """The name within the first MTP module of a ``layout`` checkpoint's tensor ``key``
    (None: not one of its tensors), for a model of ``layers`` layers."""
    match = layout.key.match(key)
    if match is None:
        return None
    index = match.groupdict().get("index")
    if index is not None and int(index) - (layers if layout.after_layers else 0) != 0:
        return None
    return match.group("name")


def is_mtp(key: str, model_type: Optional[str], layers: int) -> bool:
    """Whether a checkpoint's tensor ``key`` is part of an MTP module (any of them) of a
    ``model_type`` model of ``layers`` layers: what mlx-lm's sanitize drops."""
    layout = LAYOUTS.get(model_type, QWEN)
    match = layout.key.match(key)
    if match is None:
        return False
    index = match.groupdict().get("index")
    return index is None or not layout.after_layers or int(index) >= layers


def _ours(layout: Layout, name: str) -> Optional[str]:
    """A name within a ``layout`` module as Qwen's layout has it (None: not read)."""
    for theirs, ours in layout.renamed:
        if name.startswith(theirs):
            return None if ours is None else ours + name[len(theirs):]
    return layout.layer + name


def sanitize_mtp(weights: Dict[str, mx.array], model: nn.Module, raw: Optional[bool] = None) -> Dict[str, mx.array]:
    """The MTP tensors of a checkpoint's ``weights`` for ``model`` (its family says the
    layout), in mlx-lm's layout under Qwen's names: experts stacked, from a ``raw``
    checkpoint (default: as its kernels say) of a family that stores them so norms as
    weights rather than offsets from 1, and where the model's own sanitize knows the decoder
    layer's tensors (DeepSeek's), through it."""
    layout = LAYOUTS.get(getattr(model.args, "model_type", None), QWEN)
    raw = is_raw(weights) if raw is None else raw
    layers = getattr(model.args, "num_hidden_layers", 0)
    found, converted = {}, {}
    for key, value in weights.items():
        name = _matched(layout, key, layers)
        ours = None if name is None else _ours(layout, name)
        if ours is not None:
            found["mtp." + ours] = value
        elif layout is not QWEN and QWEN.key.match(key):  # already ours: a conversion's mtp.safetensors
            converted[key] = value
    if layout.model_sanitizes:  # as the model's layer 0, through its own sanitize, and back
        prefix = "mtp." + layout.layer
        own = {"model.layers.0." + k[len(prefix):]: v for k, v in found.items() if k.startswith(prefix)}
        found = {k: v for k, v in found.items() if not k.startswith(prefix)}
        found.update({prefix + k[len("model.layers.0."):]: v for k, v in model.sanitize(own).items()
                      if k.startswith("model.layers.0.")})
    experts: Dict[str, Dict[int, mx.array]] = {}
    out = {}
    for key, value in found.items():
        expert = re.match(r"(.*\.mlp)\.experts\.(\d+)\.(\w+_proj)\.weight$", key)
        if expert:
            stacked = f"{expert.group(1)}.switch_mlp.{expert.group(3)}.weight"
            experts.setdefault(stacked, {})[int(expert.group(2))] = value
            continue
        shifted = raw and layout.delta_norms and value.ndim == 1 and key.endswith(_NORMS)
        out[key] = value + 1.0 if shifted else value
    for key, parts in experts.items():
        out[key] = mx.stack([parts[e] for e in sorted(parts)])
    return out | converted


class MTPModule(nn.Module):
    """A model's MTP module with the Head interface (heads.py): EagleDrafter drafts with it."""

    family = "mtp"
    traceable = True  # array code only: tree_growth.py compiles its static drafts where target.py drives the target

    def __init__(self, target: nn.Module, layer: nn.Module, layout: Layout = QWEN):
        super().__init__()
        hidden, eps = target.args.hidden_size, target.args.rms_norm_eps
        self.layout = layout  # the concatenation's order, the first embedding
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
        if self.layout.zero_first:
            at = positions + mx.arange(tokens.shape[-1]) if isinstance(positions, int) else positions
            embedding = mx.where((at == 0)[..., None], 0, embedding)
        parts = [self.pre_fc_norm_embedding(embedding), self.pre_fc_norm_hidden(hidden.astype(embedding.dtype))]
        x = self.fc(mx.concatenate(parts[::-1] if self.layout.hidden_first else parts, axis=-1))
        if is_driven(target):  # a tree's positions and mask, as the target's own layers see them
            return self.norm(decoder_layer(self.layers[0], x, cache[0], positions, mask))
        return self.norm(self.layers[0](x, mask=mask, cache=cache[0]))  # a hybrid's chain, where its cache ends

    def logits(self, target: nn.Module, hidden: mx.array) -> mx.array:
        return lm_head(target, hidden)

    def target_ids(self, draft_ids: mx.array) -> mx.array:
        return draft_ids


def module_for(model: nn.Module, weights: Dict[str, mx.array], source) -> Optional[MTPModule]:
    """The MTP module held in a checkpoint's ``weights`` for ``model`` (None: it holds none),
    or one line when its MTP tensors are partial or of another shape."""

    tensors = sanitize_mtp(weights, model)
    if not tensors:
        return None
    module = _loaded(model, tensors, source)
    if mx.default_device() == mx.cpu:
        module = dequantize_model(module)
    module.set_dtype(compute_dtype(model), predicate=lambda dtype: mx.issubdtype(dtype, mx.floating))
    mx.eval(module.parameters())
    return module


def quantized(model: nn.Module, tensors: Dict[str, mx.array], group_size: int, bits: int) -> Dict[str, mx.array]:
    """A module's tensors (sanitize_mtp's) with its projections quantized as mlx-lm
    quantizes a model's (what module_for reads back)."""
    module = _loaded(model, tensors, "the MTP module")
    nn.quantize(module, group_size, bits, class_predicate=lambda path, m: hasattr(m, "to_quantized")
                and m.weight.shape[-1] % group_size == 0)
    return {f"mtp.{name}": value for name, value in tree_flatten(module.parameters())}


def _loaded(model: nn.Module, tensors: Dict[str, mx.array], source) -> MTPModule:
    """The module of ``tensors`` (sanitize_mtp's) for ``model``, or one line when they are
    partial or of another shape."""
    if getattr(model.args, "model_type", None) not in MODEL_TYPES:
        raise UserError(f"{source} holds MTP tensors for a {model.args.model_type!r} model, whose MTP layout is not "
                        f"known here (known: {', '.join(MODEL_TYPES)}); pass --draft lookup or none")
    layout = LAYOUTS[model.args.model_type]
    module = MTPModule(model, new_decoder_layer(model, after=layout.after_layers), layout)
    if any(name.endswith(".scales") for name in tensors):
        nn.quantize(module, class_predicate=lambda path, m: _stored_quantization(tensors, f"mtp.{path}", m))
    wanted = {f"mtp.{name}": value.shape for name, value in tree_flatten(module.parameters())}
    missing, extra = sorted(set(wanted) - set(tensors)), sorted(set(tensors) - set(wanted))
    shapes = sorted(n for n in set(wanted) & set(tensors) if tuple(tensors[n].shape) != tuple(wanted[n]))
    if missing or extra or shapes:
        problem = ", ".join(f"{len(names)} {what} (e.g. {names[0]})" for names, what in
                            ((missing, "missing"), (extra, "unexpected"), (shapes, "of another shape")) if names)
        raise UserError(f"{source}: its MTP tensors are not a whole module for this model: {problem}; pass --draft "
                        "lookup or none")
    module.load_weights([(name[len("mtp."):], value) for name, value in tensors.items()], strict=True)
    return module


def _stored_quantization(tensors: Dict[str, mx.array], name: str, layer: nn.Module):
    """How the tensors stored for ``layer`` (at ``name``) were quantized, from their shapes:
    ``{group_size, bits}`` (a weight of ``columns`` packs ``columns * 32 / bits`` values into
    32-bit words, one scale per group), or False where they were not."""
    scales, weight = tensors.get(f"{name}.scales"), tensors.get(f"{name}.weight")
    if scales is None or weight is None or not hasattr(layer, "to_quantized"):
        return False
    columns = layer.weight.shape[-1]
    return {"group_size": columns // scales.shape[-1], "bits": weight.shape[-1] * 32 // columns}


def new_decoder_layer(model: nn.Module, after: bool = False) -> nn.Module:
    """A new decoder layer of the model's own kind: its first full-attention layer's class
    (mlx-lm's classes take the layer's index, or only the model's arguments), built as the
    layer after the model's last where ``after`` (DeepSeek's and GLM's module: a mixture of
    experts where their later layers are). On a pipelined model, from this rank's layers
    (the others' are None here)."""
    layers = inner_model(model).layers
    index = next((i for i, layer in enumerate(layers) if layer is not None and not getattr(layer, "is_linear", False)),
                 None)
    if index is None:
        raise UserError("the model's MTP module copies an attention layer, and this rank's part of the model holds "
                        "none; pipeline it over fewer ranks")
    kind = type(layers[index])
    if len(inspect.signature(kind).parameters) == 1:
        return kind(model.args)
    return kind(model.args, layer_count(model) if after else index)
