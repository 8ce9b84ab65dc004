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
interface and EagleDrafter grows its chains (trees where target.py drives the target: MiMo;
Qwen's hybrids verify chains), its KV cache holding the committed positions and cut back
each round. Every family's tensors are brought to one layout, Qwen's (``mtp.fc``,
``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.layers.0.*``,
``mtp.norm``): raw Qwen checkpoints store the norms as offsets from 1 and the experts one by
one, and MiMo names its parts otherwise.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

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


@dataclass(frozen=True)
class Layout:
    """Where a family's checkpoints keep its MTP module and what they call its parts.
    ``key``: its tensors' names (group ``name``: the name within the module; ``index``: the
    module's, where there are several: the first drafts, at every depth); ``renamed``: their
    names for the parts around the decoder layer -> Qwen's; ``layer``: where the decoder
    layer's own tensors are within the module; ``hidden_first``: the concatenation's order;
    ``delta_norms``: raw checkpoints store norms as offsets from 1."""

    key: re.Pattern
    renamed: Tuple[Tuple[str, str], ...] = ()
    layer: str = ""
    hidden_first: bool = False
    delta_norms: bool = False


QWEN = Layout(re.compile(r"^(?:model\.|language_model\.)*mtp\.(?P<name>.*)"), delta_norms=True)
MIMO = Layout(re.compile(r"^model\.mtp_layers\.(?P<index>\d+)\.(?P<name>.*)"),
              (("input_proj.", "fc."), ("token_layernorm.", "pre_fc_norm_embedding."),
               ("hidden_layernorm.", "pre_fc_norm_hidden."), ("final_layernorm.", "norm.")),
              layer="layers.0.", hidden_first=True)
LAYOUTS = {"qwen3_next": QWEN, "qwen3_5_text": QWEN, "qwen3_5_moe_text": QWEN, "mimo": MIMO}
MODEL_TYPES = tuple(LAYOUTS)
MTP_KEY = re.compile(r"^(?:(?:model\.|language_model\.)*mtp\.|model\.mtp_layers\.\d+\.)")  # any family's tensors


def is_raw(weights: Dict[str, mx.array]) -> bool:
    """A Hugging Face checkpoint as published (not mlx-lm's layout): its convolution
    kernels are [channels, 1, width]."""
    return any("conv1d.weight" in k and v.shape[-1] != 1 for k, v in weights.items())


def _ours(layout: Layout, name: str) -> str:
    """A name within a ``layout`` module as Qwen's layout has it."""
    for theirs, ours in layout.renamed:
        if name.startswith(theirs):
            return ours + name[len(theirs):]
    return layout.layer + name


def sanitize_mtp(weights: Dict[str, mx.array], raw: bool) -> Dict[str, mx.array]:
    """The MTP tensors of a checkpoint's ``weights`` (any family's), in mlx-lm's layout
    under Qwen's names: experts stacked, and, from a ``raw`` checkpoint of a family that
    stores them so, norms as weights rather than offsets from 1."""
    found = {}
    for key, value in weights.items():
        for layout in (QWEN, MIMO):
            match = layout.key.match(key)
            if match and match.groupdict().get("index") in (None, "0"):
                shifted = raw and layout.delta_norms and value.ndim == 1
                found["mtp." + _ours(layout, match.group("name"))] = (value, shifted)
                break
    experts: Dict[str, Dict[int, mx.array]] = {}
    out = {}
    for key, (value, shifted) in found.items():
        expert = re.match(r"(.*\.mlp)\.experts\.(\d+)\.(\w+_proj)\.weight$", key)
        if expert:
            stacked = f"{expert.group(1)}.switch_mlp.{expert.group(3)}.weight"
            experts.setdefault(stacked, {})[int(expert.group(2))] = value
            continue
        out[key] = value + 1.0 if shifted and key.endswith(_NORMS) else value
    for key, parts in experts.items():
        out[key] = mx.stack([parts[e] for e in sorted(parts)])
    return out


class MTPModule(nn.Module):
    """A model's MTP module with the Head interface (heads.py): EagleDrafter drafts with it."""

    family = "mtp"

    def __init__(self, target: nn.Module, layer: nn.Module, hidden_first: bool = False):
        super().__init__()
        hidden, eps = target.args.hidden_size, target.args.rms_norm_eps
        self.hidden_first = hidden_first  # the concatenation's order (Layout)
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
        parts = [self.pre_fc_norm_embedding(embedding), self.pre_fc_norm_hidden(hidden.astype(embedding.dtype))]
        x = self.fc(mx.concatenate(parts[::-1] if self.hidden_first else parts, axis=-1))
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
    module = MTPModule(model, decoder_layer(model), LAYOUTS[model.args.model_type].hidden_first)
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


def decoder_layer(model: nn.Module) -> nn.Module:
    """A new decoder layer of the model's own kind: its first full-attention layer's class
    (mlx-lm's classes take the layer's index, or only the model's arguments)."""
    layers = inner_model(model).layers
    index = next(i for i, layer in enumerate(layers) if not getattr(layer, "is_linear", False))
    kind = type(layers[index])
    return kind(model.args, index) if len(inspect.signature(kind).parameters) > 1 else kind(model.args)


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
