"""What drafts, decided once: the ``DraftPlan`` and the one policy that makes it.

Every entry point (the API, the commands, ``Engine``/``ChatSession``, the server, bench
and tune) turns its draft choice into a plan with ``plan_drafts`` when the model and its
drafters are loaded, and hands the plan on; ``stream_generate`` makes one itself when
given a head, a drafter or a word.

The draft choice (``--draft``, ``draft=``):
  "auto"     the model's own drafter where there is one (its MTP module, a head shipped
             for it: the one with the higher recorded acceptance), and drafts from the context
  "lookup"   drafts from the context alone (any model mlx-lm loads), as None does
  "none"     plain decoding through the same loop
  a path     a drafter's directory; each kind in drafters.kinds.KINDS says whether it is its own
  "package.module:Name", or the name of an installed entry point (group "mlx_eagle.drafters")
             your own drafter: a ``Drafter`` subclass or function making one (called with
             the ``model`` and ``tokenizer`` its parameters name), or a ``Drafter`` object
  an object  a loaded head (load_draft), or your own ``Drafter`` (or its class)
Drafts from the context join every choice but "none" unless ``lookup=False``. Your own
drafter drafts fresh for every conversation: an object is forked (``Drafter.fork``), a
class or function called again, whenever a prompt does not continue the conversation
it drafted for.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import queue
import re
import threading
import weakref
from dataclasses import astuple, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .drafters.calibrate import head_acceptance
from .configs import read_config
from .drafters import Budget, Drafter, Outcome, Proposal
from .drafters.admit import warn_once
from .drafters.composite import Composite, SourceStats
from .drafters.history import History, for_model, model_identity
from .drafters.kinds import DraftSettings, DraftSource, kind_modules
from .errors import UserError, did_you_mean
from .hub import from_hub
from .models import load_target, resolve_model
from .node_odds import PLAN_DECAY, NodeOdds
from .target import KVQuantization, kv_quantization
from .trees import TreeSpec

WORDS = ("auto", "lookup", "none")


@dataclass
class DraftPlan:
    """The drafters for one model: each source in the order it drafts (those that decided
    not to draft here say why in ``note``), and the settings they were made with."""

    sources: List[DraftSource]
    settings: DraftSettings
    key: Tuple = field(default=())  # what the plan was made from: equal keys, equal plans
    # What its conversations' batched rounds saw accepted, by depth and rank, recent ones
    # weighing most: a new conversation's odds start from it (node_odds.NodeOdds).
    odds: NodeOdds = field(default_factory=lambda: NodeOdds(decay=PLAN_DECAY), compare=False, repr=False)

    @property
    def active(self) -> List[DraftSource]:
        return [source for source in self.sources if source.make is not None]

    @property
    def notes(self) -> List[str]:
        return [source.note for source in self.sources if source.note]

    @property
    def off(self) -> List[str]:
        """The sources that decided not to draft here, and why."""
        return [f"{source.name}: {source.note}" for source in self.sources if source.make is None]

    @property
    def head(self):
        """The EAGLE head drafting in this plan, if any."""
        return next((s.draft for s in self.active if s.draft is not None), None)

    def describe(self) -> str:
        """What drafts, in words: the drafts: line."""
        return " + ".join(source.name for source in self.active) or "none (plain decoding)"

    def drafter(self) -> Optional[Composite]:
        """Fresh drafters for one conversation, merged (and counted per source); None:
        plain decoding."""
        made = [source.make() for source in self.active]
        return Composite(made, [source.name for source in self.active]) if made else None


def source_statistics(drafter: Optional[Drafter]) -> Dict[str, SourceStats]:
    """Per source, the nodes it added to verified trees and how many were accepted."""
    return drafter.statistics() if isinstance(drafter, Composite) else {}


def drafters_failed(drafter: Optional[Drafter]) -> List[str]:
    """The sources that failed during this conversation and went off, and why."""
    if not isinstance(drafter, Composite):
        return []
    return [f"{name}: {one.failure}" for name, one in zip(drafter.names, drafter.drafters)
            if getattr(one, "failure", None)]


DRAFTER_GROUP = "mlx_eagle.drafters"  # installed packages' entry points: name = "package.module:Name"
_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


@dataclass
class UserDrafter:
    """Your own drafter, named on a command line or handed to the API: ``made`` is a
    ``Drafter`` object (forked per conversation), or a class or function that makes one."""

    made: Any
    name: str

    def factory(self, model: nn.Module, tokenizer: Any) -> Callable[[], Drafter]:
        """What makes a fresh drafter for each conversation."""
        if isinstance(self.made, Drafter):
            return self.made.fork
        parameters = inspect.signature(self.made).parameters
        given = {"model": model, "tokenizer": tokenizer}
        missing = [p.name for p in parameters.values() if p.default is p.empty and p.name not in given
                   and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if missing:
            raise UserError(f"draft {self.name} needs {', '.join(missing)}, which only model and tokenizer can be "
                            "given; give them defaults")
        arguments = {name: value for name, value in given.items() if name in parameters}

        def make() -> Drafter:
            drafter = self.made(**arguments)
            if not isinstance(drafter, Drafter):
                raise UserError(f"draft {self.name} made a {type(drafter).__name__}, not an mlx_eagle.Drafter")
            return drafter

        return make


def user_drafter(draft: object) -> Optional[UserDrafter]:
    """``draft`` as your own drafter: a ``package.module:Name`` spec or an installed entry
    point's name (imported now: one line when the module or name is missing, or is not a
    Drafter), a ``Drafter`` subclass or object; None for anything else."""
    if isinstance(draft, Drafter):
        return UserDrafter(draft, type(draft).__name__)
    if isinstance(draft, type) and issubclass(draft, Drafter):
        return UserDrafter(draft, draft.__name__)
    if not isinstance(draft, str) or draft in WORDS or Path(draft).expanduser().exists():
        return None
    spec = draft
    if not _SPEC.fullmatch(draft):
        found = [e for e in importlib.metadata.entry_points(group=DRAFTER_GROUP) if e.name == draft]
        if not found:
            return None
        spec = found[0].value
    module_name, _, attribute = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(f"draft {draft}: cannot import {module_name} ({exc}); is it installed or on PYTHONPATH?") \
            from None
    except (Exception, SystemExit) as exc:  # the module's own code failed (a SyntaxError, a sys.exit, ...)
        raise UserError(f"draft {draft}: importing {module_name} failed ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else 'no message'}); fix the module") from None
    made = getattr(module, attribute, None)
    if made is None:
        raise UserError(f"draft {draft}: {module_name} has no {attribute}{did_you_mean(attribute, dir(module))}")
    if isinstance(made, Drafter) or (isinstance(made, type) and issubclass(made, Drafter)) or \
            (callable(made) and not isinstance(made, type)):
        return UserDrafter(made, draft)
    what = "class" if isinstance(made, type) else type(made).__name__
    raise UserError(f"draft {draft}: {attribute} is a {what}, not an mlx_eagle.Drafter, a Drafter subclass or a "
                    "function that makes one")


# Seconds a plug-in drafter's calls other than ``propose`` may take (``propose``: its own
# ``time_limit``) before its conversation goes on without it: they learn or tidy, and a
# batch's round waits for them. Making it may load weights, so it gets longer.
CALL_LIMIT = 10.0
MAKE_LIMIT = 60.0


class FreshPerConversation(Drafter):
    """Your drafter, made afresh whenever a prompt does not continue the conversation it
    drafted for (a new chat, another client of the server); within one it lives on.

    Contained: an exception from your code (making or forking it, ``propose``, ``observe``,
    ``reusable``, ``branch``, ``finish``) warns once, naming the drafter and the error, and
    the conversation goes on without it; a call that takes too long is abandoned the same
    way: ``propose`` past the drafter's ``time_limit``, any other call past CALL_LIMIT (making
    it past MAKE_LIMIT). The text is the model's either way. Its calls run on a thread of
    their own (``_Runner``), so that one that never returns holds nothing of the engine's
    beyond its bound, and only its own conversation loses its drafts."""

    def __init__(self, make: Callable[[], Drafter], name: str = "yours"):
        self.make, self.name = make, name
        self.failure: Optional[str] = None  # why it went off in this conversation
        self.runner: Optional[_Runner] = _Runner()
        self.current: Optional[Drafter] = None
        self.current = self._contained("making it", make)
        self.taps = self.current.taps if self.current is not None else None
        self.prompt_length = 0  # the last prompt read: a prompt continuing the conversation begins with it

    def _contained(self, what: str, call: Callable[[], Any], limit: Optional[float] = None) -> Any:
        """``call()`` on the drafter's thread (None once the drafter is off); an error, or a
        call past its bound (``propose``: ``limit`` seconds, None for none; any other call:
        CALL_LIMIT, or MAKE_LIMIT making it), turns it off for this conversation with one warning."""
        if what != "propose":
            limit = MAKE_LIMIT if what == "making it" else CALL_LIMIT
        if self.runner is None and what == "making it":  # a new conversation: a new thread (the last may be stuck)
            self.runner = _Runner()
        if self.runner is None or (self.current is None and what != "making it"):
            return None
        try:
            return self.runner.run(call, limit)
        except _TooLong:
            bound = "its time_limit" if what == "propose" else "the bound on a drafter's calls"
            problem = f"{what} took longer than {bound} ({limit:g} s)"
        except BaseException as error:  # your code's, whatever it is (a sys.exit too: it ran on the drafter's thread)
            problem = f"{what} failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        warn_once(self.make, f"drafter {self.name}: {problem}; its conversation went on without it")
        self.current, self.failure = None, problem
        if limit is not None:  # the thread may be stuck in the call: left to it
            self.runner.stop()
            self.runner = None
        return None

    def reusable(self, common: int) -> int:
        if common < self.prompt_length:
            self.current, self.prompt_length = self._contained("making it", self.make), 0
        reusable = self._contained("reusable", lambda: self.current.reusable(common))
        return common if reusable is None else reusable

    def branch(self) -> "FreshPerConversation":
        return FreshPerConversation(self.make, self.name)  # your drafter, fresh

    def propose(self, budget: Budget) -> Optional[Proposal]:
        limit = getattr(self.current, "time_limit", None)
        return self._contained("propose", lambda: _evaluated(self.current.propose(budget)), limit)

    def observe(self, outcome: Outcome) -> None:
        if outcome.from_prompt:
            self.prompt_length = len(outcome.tokens) - 1
        if self.current is not None and outcome.states is not None:
            states = outcome.states  # computed on the engine's thread: evaluated there, read on the runner's
            mx.eval([a for a in (states.features, states.hidden, states.rows) if a is not None])
        self._contained("observe", lambda: self.current.observe(outcome))

    def finish(self) -> None:
        self._contained("finish", lambda: self.current.finish())


def _evaluated(proposal: Any) -> Any:
    """A proposal's tokens computed where they were made (a lazy array belongs to its thread)."""
    if isinstance(getattr(proposal, "tokens", None), mx.array):
        mx.eval(proposal.tokens)
    return proposal


class _TooLong(Exception):
    """A drafter's call ran past its time limit."""


def run_jobs(next_job: Callable[[], Optional[Callable[[], Any]]]) -> None:
    """A worker thread's loop: MLX work on a stream of its own (MLX streams belong to the
    thread that made them), one job at a time (``next_job()``: a queue's get, or the Engine's
    scheduler), until None."""
    mx.set_default_stream(mx.new_stream(mx.default_device()))
    for job in iter(next_job, None):
        job()
        del job  # a finished job may hold what made it, which could then never be collected
    # a stream left to the C++ teardown of a finished thread aborts the process at exit
    mx.synchronize()
    mx.clear_streams()


class _Runner:
    """A thread with its own MLX stream that runs one drafter's calls, one at a time; a call
    that outlasts its limit is left running there (the thread is then abandoned). The thread
    ends when the runner is collected (it holds only the queue, not the runner)."""

    def __init__(self):
        self.jobs: "queue.Queue" = queue.Queue()
        threading.Thread(target=run_jobs, args=(self.jobs.get,), name="mlx-eagle-drafter", daemon=True).start()
        self._finalizer = weakref.finalize(self, self.jobs.put, None)

    def run(self, call: Callable[[], Any], limit: Optional[float]) -> Any:
        box: "queue.Queue" = queue.Queue()

        def job() -> None:
            try:
                box.put((True, call()))
            except BaseException as error:  # handed to the caller
                box.put((False, error))

        self.jobs.put(job)
        try:
            ok, value = box.get(timeout=limit)
        except queue.Empty:
            raise _TooLong from None
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        self._finalizer()


def _kind(name: str):
    return next(kind for kind in kind_modules() if kind.NAME == name)


def drafter_kind(path: Path, config: Optional[dict]) -> Optional[str]:
    """The name of the first drafter kind that recognizes ``path`` (None: none does)."""
    return next((kind.NAME for kind in kind_modules() if kind.recognizes(path, config)), None)


def path_kind(path: Path):
    """The kind whose drafter ``path`` (a directory, or a file such as a GGUF) holds, or one
    line saying what it looks like."""
    config = read_config(path, "a drafter's directory (an EAGLE head, a draft model, ...)") if path.is_dir() else None
    for kind in kind_modules():
        if kind.recognizes(path, config):
            return kind
    kinds = ", ".join(k.NAME for k in kind_modules())
    if config is None:
        raise UserError(f"draft {path} is a file that no drafter kind reads ({kinds}); pass a drafter's directory "
                        "or a .gguf model")
    layers, model_type = config.get("num_hidden_layers"), config.get("model_type")
    looks = f"a {model_type} model with {layers} layers and no tokenizer" if model_type and layers else \
        "no drafter this runtime knows"
    raise UserError(f"{path} looks like {looks}, not a drafter ({kinds})")


def best_shipped(drafters: List[object]) -> Optional[object]:
    """Of the drafters that come with a model (its own MTP module, a head shipped for it),
    the one whose recorded acceptance promises the longest chains (tokens per round on a
    chain of its recorded depth); the first on a tie, in KINDS order (the model's own first)."""
    def chain_tokens(drafter: object) -> float:
        return 1.0 + float(np.cumprod(head_acceptance(drafter)[0][:, 0]).sum())

    return max(drafters, key=chain_tokens, default=None)


def load_draft(draft: Union[str, Path, None, object], model: nn.Module):
    """What ``draft`` drafts with, loaded for ``model``: a drafter's directory loaded by its
    kind, "auto" the drafter shipped for this model (None if there is none), your own
    drafter as a ``UserDrafter``, and None for "none", "lookup" and None. Anything else is
    returned as it is."""
    if draft is None or draft in ("none", "lookup"):
        return None
    mine = user_drafter(draft)
    if mine is not None:
        return mine
    if draft == "auto":
        return best_shipped([found for kind in kind_modules() if hasattr(kind, "shipped")
                             for found in [kind.shipped(model)] if found is not None])
    if isinstance(draft, (str, Path)):
        path = Path(draft).expanduser()
        if not path.exists() and isinstance(draft, str) and draft.count("/") == 1 and not draft.startswith((".", "~")):
            path = from_hub(draft)  # a Hugging Face repo id: a head or a draft model, fetched when online
        if not path.exists():
            raise UserError(f"draft {draft} does not exist{did_you_mean(str(draft), WORDS)}; pass a drafter's "
                            f"directory, or one of {', '.join(WORDS)}")
        return path_kind(path).load(path, model)
    return draft


def open_target(model: Optional[str] = None, tokenizer_config: Optional[Dict[str, Any]] = None,
                pipeline: bool = False) -> Tuple[nn.Module, Any, Path]:
    """models.load_target for a --model value, refusing a drafter's directory in one line
    before anything loads: (model, tokenizer, its directory). ``pipeline``: under
    mlx.launch, split the model by layers rather than by heads."""
    path = resolve_model(model)
    kind = drafter_kind(path, read_config(path, "an MLX or Hugging Face model directory"))
    if kind is not None and kind != "draft model":
        raise UserError(f"{path} holds {kind} weights, a drafter, not a model: pass it as --draft, and the model it "
                        "drafts for as --model")
    return load_target(str(path), tokenizer_config, pipeline=pipeline)


def load(path_or_hf_repo: Optional[str] = None, draft: Optional[str] = None,
         tokenizer_config: Optional[Dict[str, Any]] = None, pipeline: bool = False):
    """Like mlx_lm.load: ``(model, tokenizer)``; with ``draft`` (a drafter's directory or
    "auto", see load_draft) ``(model, tokenizer, drafter weights)``, None when "auto" finds
    none. Under mlx.launch, every rank loads its shard of the model (as mlx-lm's
    ``sharded_load``: split by heads, or by layers with ``pipeline``)."""
    model, tokenizer, _ = open_target(path_or_hf_repo, tokenizer_config, pipeline)
    if draft is None:
        return model, tokenizer
    return model, tokenizer, load_draft(draft, model)


def history_of(model: nn.Module, history: Union[bool, str, Path, "History", None], key: str = ""):
    """The earlier replies to draft from: True, this process's for ``model`` (and ``key``,
    the server's model id); a path, the file's (loaded and saved); False or None, none."""
    if history is None or history is False:
        return None
    if history is True:
        return for_model(model, key)
    if isinstance(history, History):
        return history
    return History.open(Path(history), model_identity(model))


def _kv_text(kv: Optional[KVQuantization]) -> str:
    return "kv_bits None" if kv is None else f"kv_bits {kv.bits}, kv_group_size {kv.group_size}, " \
                                             f"quantized_kv_start {kv.start}"


def plan_drafts(model: nn.Module, draft: Union[str, Path, None, object] = "auto",
                tree: Union[str, TreeSpec, None] = "auto", lookup: bool = True,
                history: Union[bool, str, Path, object, None] = True, tokenizer: Any = None,
                kv_bits: Optional[int] = None, kv_group_size: int = 64,
                quantized_kv_start: Optional[int] = None) -> DraftPlan:
    """The one policy: what drafts for ``model`` given the user's draft choice (see the
    module's docstring), the head's ``tree``, whether to draft from the context, and from
    which ``history`` of earlier replies (see ``history_of``); ``tokenizer``: the model's,
    for your own drafter's class or function to take. ``kv_bits``, ``kv_group_size``,
    ``quantized_kv_start``: the quantized KV caches the plan's generations use (as
    stream_generate takes them), which price verification differently (costs.verify_costs)."""
    kv = kv_quantization(kv_bits, kv_group_size, quantized_kv_start)
    if kv is not None:
        kv.check_model(model)  # one line, before anything is timed
    if isinstance(draft, DraftPlan):
        if draft.settings.kv != kv:
            raise UserError(f"this draft plan was made for other KV cache settings ({_kv_text(draft.settings.kv)}, "
                            f"not {_kv_text(kv)}); make it with plan_drafts(..., kv_bits=...) as you generate")
        return draft
    if draft == "none":
        lookup = False
    history = history_of(model, history) if lookup else None
    key = (id(model), draft if isinstance(draft, (str, Path, type(None))) else id(draft),
           tree.text if isinstance(tree, TreeSpec) else tree, lookup, id(history), kv and astuple(kv))
    loaded = load_draft(draft, model)
    settings = DraftSettings(model, tree, history, kv)
    sources = []
    if isinstance(loaded, UserDrafter):
        make = loaded.factory(model, tokenizer)
        sources.append(DraftSource(loaded.name, lambda: FreshPerConversation(make, loaded.name)))
    elif loaded is not None:
        kind = next((k for k in kind_modules() if k.accepts(loaded)), None)
        if kind is None:
            raise UserError(f"draft {loaded!r}: pass a head (mlx_eagle.load_draft), a Drafter, or one of "
                            f"{', '.join(WORDS)}")
        sources.append(kind.source(loaded, model, settings))
    if lookup:
        sources.append(_kind("lookup").source("lookup", model, settings))
    return DraftPlan(sources, settings, key)

