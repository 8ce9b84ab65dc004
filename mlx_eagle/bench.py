"""Benchmark EAGLE against plain mlx-lm decoding (and mlx-lm's draft-model speculative
decoding), side by side in one run: same model object, dtype, prompts and machine.

    python -m mlx_eagle.bench --suite mt-bench --max-turns 1 --max-tokens 128 --out results.json

Methods alternate per prompt, so drift of a shared machine hits all alike; one warm-up
prompt runs first and is not counted. Writes JSON (per method and per prompt), prints a
table, and with --plot draws speedup and tau per category.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import mlx.core as mx

from .blas import blas_in_use
from .cli import TREE_HELP, add_kv_arguments, add_model_arguments, add_sampling_arguments, kv_options, new_parser, \
    run_cli, use_fast_blas
from .data import mtbench_questions
from .drafters.history import History, model_identity
from .errors import UserError
from .files import write_atomically
from .progress import progress_bar
from .trees import parse_tree

if TYPE_CHECKING:
    from .verify import Sampling

# baseline: plain mlx-lm; default: what the commands do with the --draft and --tree given (by
# default the model's own drafter and drafts from the context and earlier replies);
# default-no-history: the same without earlier replies; drafter: the --draft drafter alone (a head, a
# DFlash drafter or a draft model); lookup: drafts
# from the context (and earlier replies) alone; drafter+lookup: both in one tree; draft-model: mlx-lm's;
# none: plain decoding through our own loop (--draft none).
METHODS = ("baseline", "default", "default-no-history", "drafter", "lookup", "drafter+lookup", "draft-model", "none")


@dataclass
class BenchPrompt:
    id: str
    category: str
    turns: List[str] = field(default_factory=list)  # user turns, asked in order
    messages: List[dict] = field(default_factory=list)  # or a fixed conversation to answer


@dataclass
class Answer:
    tokens: List[int]
    seconds: float  # prompt processing included
    first_seconds: float  # until the first token: the prompt read and its token chosen
    rounds: List[int]  # accepted draft tokens per target forward (speculative methods)
    sources: Dict[str, List[int]] = field(default_factory=dict)  # per drafter: [nodes proposed, accepted]
    rechecked: int = 0  # greedy positions too close to call in a block, decided by a one-row pass


def _prompt_from_record(record: object, where: str) -> BenchPrompt:
    from .replies import check_messages

    if not isinstance(record, dict):
        raise UserError(f"{where}: expected a JSON object with 'prompt', 'turns' or 'messages'")
    ident = str(record.get("id", record.get("question_id", where)))
    category = str(record.get("category", "all"))
    shapes = [k for k in ("prompt", "turns", "messages") if k in record]
    if len(shapes) != 1:
        raise UserError(f"{where}: give exactly one of 'prompt', 'turns' or 'messages' (found {shapes or 'none'})")
    value = record[shapes[0]]
    if shapes[0] == "prompt":
        if not isinstance(value, str) or not value:
            raise UserError(f"{where}: 'prompt' must be a non-empty string")
        return BenchPrompt(ident, category, turns=[value])
    if shapes[0] == "turns":
        if not value or not all(isinstance(t, str) and t for t in value):
            raise UserError(f"{where}: 'turns' must be a list of non-empty strings")
        return BenchPrompt(ident, category, turns=list(value))
    return BenchPrompt(ident, category, messages=check_messages(value, f"{where}: messages"))


def read_prompts(path: Path) -> List[BenchPrompt]:
    """A JSONL prompt file: one object per line with ``id``, optional ``category``, and
    ``prompt`` (one user turn), ``turns`` (asked in order) or ``messages``."""
    if not path.is_file():
        raise UserError(f"no prompt file at {path}")
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise UserError(f"{path}:{number}: not valid JSON ({error.msg}); write one JSON object per line") from None
        prompts.append(_prompt_from_record(record, f"{path}:{number}"))
    if not prompts:
        raise UserError(f"{path} holds no prompts")
    return prompts


def mtbench_suite() -> List[BenchPrompt]:
    """The 80 MT-bench questions, two turns each."""

    return [_prompt_from_record(q, f"MT-bench {q['question_id']}") for q in mtbench_questions()]


def first_turns(edit_file: Path, limit: int) -> Dict[str, List[str]]:
    """The two prompt sets README's figures are measured on, first turns only: edit-style
    prompts (``edit_file``) and MT-bench, ``limit`` of each."""
    return {"edit": [p.turns[0] for p in read_prompts(edit_file)][:limit],
            "mt-bench": [p.turns[0] for p in mtbench_suite()][:limit]}


def edit_and_mtbench(doc: str, out: Path, limit: int, measure: Callable, line: Callable[[dict], str],
                     argv: Optional[Sequence[str]] = None) -> None:
    """A benchmark script's main for SmolLM2 with the head shipped for it, on README's two
    prompt sets: ``--limit`` first turns of each, ``--max-tokens``, ``--out`` JSON;
    ``measure(model, tokenizer, head, texts, max_tokens)`` gives a set's row, ``line`` says
    it."""
    from .plan import load

    use_fast_blas()
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--limit", type=int, default=limit, help="prompts of each set")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=out)
    args = parser.parse_args(argv)
    model, tokenizer, head = load(draft="auto")
    results = {}
    for name, prompts in first_turns(out.parent.parent / "prompts" / "edit.jsonl", args.limit).items():
        results[name] = row = measure(model, tokenizer, head, prompts, args.max_tokens)
        print(f"{name:9s} {line(row)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"limit": args.limit, "max_tokens": args.max_tokens, **results}, indent=1) + "\n")
    print(f"wrote {args.out}")


def machine() -> Dict[str, str]:
    return {"platform": platform.platform(), "processor": platform.machine(), "cpus": str(os.cpu_count()),
            "device": str(mx.default_device()), "blas": blas_in_use(), "mlx": mx.__version__, "commit": commit()}


def commit() -> str:
    """The code that measured: this checkout's commit, "+changes" when it differs from it
    ("unknown" outside a git checkout)."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "mlx_eagle"],
                                 cwd=root, capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+changes" if changed else "")


Generator = Callable[[List[int]], Answer]


def accepted_per_round(from_draft: Sequence[bool]) -> List[int]:
    """Draft tokens accepted in each round: a round's accepted tokens are followed by the
    target's own (bonus) token, which closes it; a stream that stops inside a round (at
    end of sequence or the token limit) ends with that round's accepted tokens. The first
    token comes from prefill."""
    rounds, run_length = [], 0
    for drafted in from_draft[1:]:
        if drafted:
            run_length += 1
        else:
            rounds.append(run_length)
            run_length = 0
    return rounds + ([run_length] if run_length else [])


def timed(responses: Iterable) -> Tuple[list, float, float]:
    """Drain a token stream: (responses, seconds in all, seconds until the first)."""
    tic = time.perf_counter()
    collected, first = [], 0.0
    for response in responses:
        collected.append(response)
        first = first or time.perf_counter() - tic
    return collected, time.perf_counter() - tic, first


def speculative_method(model, tokenizer, plan, max_tokens: int, sampling: Sampling,
                       seed: Optional[int] = None, kv: Optional[dict] = None) -> Generator:
    """Our decoding with the drafters of ``plan`` (a DraftPlan); ``kv``: quantized KV caches
    (cli.kv_options)."""
    from .generation import stream_generate

    def run(ids: List[int]) -> Answer:
        responses, seconds, first = timed(stream_generate(model, tokenizer, ids, max_tokens=max_tokens, draft=plan,
                                                          seed=seed, **asdict(sampling), **(kv or {})))
        sources = responses[-1].sources if responses else {}
        return Answer([r.token for r in responses], seconds, first,
                      accepted_per_round([r.from_draft for r in responses]),
                      {name: [stats.proposed, stats.accepted] for name, stats in sources.items()},
                      responses[-1].rechecked if responses else 0)

    return run


def mlx_lm_method(model, tokenizer, max_tokens: int, sampling: Sampling, seed: Optional[int] = None,
                  draft_model=None, num_draft_tokens: int = 3, kv: Optional[dict] = None) -> Generator:
    """Plain mlx-lm decoding, or its draft-model speculative decoding; ``kv``: quantized KV
    caches (cli.kv_options), with mlx-lm's own prompt reading (ours reads as it does then)."""
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    def run(ids: List[int]) -> Answer:
        sampler = make_sampler(0.0 if sampling.greedy else sampling.temp, top_p=sampling.top_p, min_p=sampling.min_p,
                               top_k=sampling.top_k)
        if seed is not None:
            mx.random.seed(seed)
        extra = {"draft_model": draft_model, "num_draft_tokens": num_draft_tokens} if draft_model is not None else {}
        if kv and kv["kv_bits"] is not None:
            extra.update(kv)
        # Every token, the end-of-sequence one too, as ours yields it.
        responses, seconds, first = timed(stream_generate(model, tokenizer, mx.array(ids), max_tokens=max_tokens,
                                                          sampler=sampler, **extra))
        rounds = accepted_per_round([r.from_draft for r in responses]) if draft_model is not None else []
        return Answer([r.token for r in responses], seconds, first, rounds)

    return run


def conversation(prompt: BenchPrompt, tokenizer, generate: Generator) -> List[Answer]:
    """Ask every turn in order, keeping each answer in the conversation."""
    from .replies import chat_tokens

    if prompt.messages:
        return [generate(chat_tokens(tokenizer, prompt.messages))]
    messages, answers = [], []
    eos = set(tokenizer.eos_token_ids)
    for turn in prompt.turns:
        messages.append({"role": "user", "content": turn})
        answer = generate(chat_tokens(tokenizer, messages))
        answers.append(answer)
        messages.append({"role": "assistant", "content": tokenizer.decode([t for t in answer.tokens if t not in eos])})
    return answers


def acceptance_by_depth(rounds: Sequence[int]) -> List[float]:
    """P(draft token at depth d accepted | all before it were), from accepted counts per round."""
    deepest = max(rounds, default=0)
    rates = []
    for depth in range(1, deepest + 1):
        reached = sum(1 for r in rounds if r >= depth - 1)
        rates.append(sum(1 for r in rounds if r >= depth) / reached if reached else 0.0)
    return rates


def summarize(per_prompt: List[dict], rounds: List[int], peak_memory: float) -> dict:
    speeds = [p["tokens_per_s"] for p in per_prompt]
    tokens = sum(p["new_tokens"] for p in per_prompt)
    return {
        "tokens_per_s_median": statistics.median(speeds),
        "tokens_per_s_mean": statistics.fmean(speeds),
        "tokens_per_s_overall": tokens / sum(p["seconds"] for p in per_prompt),
        # after the first token: the prompt's reading left out, which every method does alike
        "decode_tokens_per_s": (sum(p["new_tokens"] - p["turns"] for p in per_prompt)
                                / sum(p["seconds"] - p["first_seconds"] for p in per_prompt)),
        "total_tokens": tokens,
        "tau": (sum(rounds) + len(rounds)) / len(rounds) if rounds else None,
        "acceptance_by_depth": acceptance_by_depth(rounds) if rounds else None,
        "peak_memory_gb": peak_memory,
    }


def run_bench(prompts: List[BenchPrompt], tokenizer, generators: Dict[str, Generator], greedy: bool,
              progress: bool = True) -> dict:
    """Every prompt through every method, methods rotating per prompt."""

    names = list(generators)
    for name in names:  # warm-up: compile paths and fill allocator caches
        conversation(BenchPrompt("warm-up", "warm-up", turns=["Say hello."]), tokenizer, generators[name])
    per_prompt: Dict[str, List[dict]] = {n: [] for n in names}
    rounds: Dict[str, List[int]] = {n: [] for n in names}
    peaks = {n: 0.0 for n in names}
    cached = {n: 0.0 for n in names}  # MLX's buffer cache after each request (what it keeps for reuse)
    texts: Dict[str, List[List[int]]] = {n: [] for n in names}
    sources: Dict[str, Dict[str, List[int]]] = {n: {} for n in names}
    rechecked = {n: 0 for n in names}
    bar = progress_bar(prompts, unit="prompt", desc="bench", disable=not progress)
    for index, prompt in enumerate(bar):
        for name in names[index % len(names):] + names[:index % len(names)]:
            mx.reset_peak_memory()
            answers = conversation(prompt, tokenizer, generators[name])
            peaks[name] = max(peaks[name], mx.get_peak_memory() / 1e9)
            cached[name] = max(cached[name], mx.get_cache_memory() / 1e9)
            new_tokens = sum(len(a.tokens) for a in answers)
            seconds = sum(a.seconds for a in answers)
            prompt_rounds = [r for a in answers for r in a.rounds]
            rounds[name] += prompt_rounds
            texts[name].append([t for a in answers for t in a.tokens])
            for answer in answers:
                rechecked[name] += answer.rechecked
                for source, counts in answer.sources.items():
                    totals = sources[name].setdefault(source, [0, 0])
                    totals[0], totals[1] = totals[0] + counts[0], totals[1] + counts[1]
            per_prompt[name].append({
                "id": prompt.id, "category": prompt.category, "new_tokens": new_tokens, "seconds": seconds,
                "first_seconds": sum(a.first_seconds for a in answers), "turns": len(answers),
                "tokens_per_s": new_tokens / seconds,
                "tau": (sum(prompt_rounds) + len(prompt_rounds)) / len(prompt_rounds) if prompt_rounds else None,
            })
        bar.set_postfix({n: f"{statistics.median(p['tokens_per_s'] for p in per_prompt[n]):.1f}t/s"
                         for n in names})
    methods = {n: summarize(per_prompt[n], rounds[n], peaks[n]) for n in names}
    for name in names:  # what each drafter added to the verified trees, and what of it was accepted
        methods[name]["drafters"] = {source: {"proposed": p, "accepted": a} for source, (p, a) in sources[name].items()}
        methods[name]["rechecked"] = rechecked[name]
        methods[name]["cache_memory_gb"] = cached[name]
    by_request = {}
    if "baseline" in methods:
        by_request = speedup_by_request(per_prompt)
    if "baseline" in methods:
        for name, summary in methods.items():
            summary["speedup"] = summary["tokens_per_s_overall"] / methods["baseline"]["tokens_per_s_overall"]
            summary["decode_speedup"] = summary["decode_tokens_per_s"] / methods["baseline"]["decode_tokens_per_s"]
            if greedy:
                summary["identical"] = texts[name] == texts["baseline"]
    return {"methods": methods, "prompts": per_prompt, "by_request": by_request}


def speedup_by_request(per_prompt: Dict[str, List[dict]]) -> Dict[str, Dict[str, List[float]]]:
    """Per method and category, each request's speedup over baseline, in the order the
    requests ran: where earlier replies are drafted from, later requests gain."""
    result: Dict[str, Dict[str, List[float]]] = {}
    for name, prompts in per_prompt.items():
        if name == "baseline":
            continue
        for mine, base in zip(prompts, per_prompt["baseline"]):
            result.setdefault(name, {}).setdefault(mine["category"], []).append(
                mine["tokens_per_s"] / base["tokens_per_s"])
    return result


def print_by_request(results: dict) -> None:
    """The first request's speedup against the later ones', per category."""
    rows = [("method", "category", "request 1", "requests 2-4", "requests 5+")]
    for name, categories in results.get("by_request", {}).items():
        for category, speedups in categories.items():
            if len(speedups) < 5:
                continue
            rows.append((name, category, f"{speedups[0]:.2f}x", f"{statistics.fmean(speedups[1:4]):.2f}x",
                         f"{statistics.fmean(speedups[4:]):.2f}x"))
    if len(rows) > 1:
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for row in rows:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))


def print_table(results: dict) -> None:
    rows = [("method", "tok/s median", "tok/s mean", "tokens", "tau", "speedup", "decode speedup", "identical",
             "peak GB", "MLX cache GB")]
    for name, m in results["methods"].items():
        rows.append((name, f"{m['tokens_per_s_median']:.1f}", f"{m['tokens_per_s_mean']:.1f}", str(m["total_tokens"]),
                     f"{m['tau']:.2f}" if m["tau"] else "-", f"{m['speedup']:.2f}x" if "speedup" in m else "-",
                     f"{m['decode_speedup']:.2f}x" if "decode_speedup" in m else "-",
                     str(m.get("identical", "-")), f"{m['peak_memory_gb']:.2f}", f"{m.get('cache_memory_gb', 0):.2f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
    for name, m in results["methods"].items():
        if m["acceptance_by_depth"]:
            print(f"{name} acceptance by depth: " + " ".join(f"{r:.2f}" for r in m["acceptance_by_depth"]))


def categories_of(results: dict) -> List[str]:
    return sorted({p["category"] for p in next(iter(results["prompts"].values()))})


def by_category(results: dict, name: str, key: str) -> List[float]:
    """Per category: ``name``'s speedup over baseline (tokens over seconds, summed), or
    its mean tau (0 where it has none)."""
    values = []
    for category in categories_of(results):
        chosen = [p for p in results["prompts"][name] if p["category"] == category]
        if key == "speedup":
            base = [p for p in results["prompts"]["baseline"] if p["category"] == category]
            values.append((sum(p["new_tokens"] for p in chosen) / sum(p["seconds"] for p in chosen))
                          / (sum(p["new_tokens"] for p in base) / sum(p["seconds"] for p in base)))
        else:
            taus = [p["tau"] for p in chosen if p["tau"]]
            values.append(statistics.fmean(taus) if taus else 0.0)
    return values


def print_categories(results: dict) -> None:
    """Speedup (and tau) of each method per category."""
    names = [n for n in results["methods"] if n != "baseline"]
    categories = categories_of(results)
    if "baseline" not in results["methods"] or len(categories) < 2 or not names:
        return
    columns = {n: by_category(results, n, "speedup") for n in names}
    taus = {n: by_category(results, n, "tau") for n in names}
    rows = [("category",) + tuple(f"{n} speedup (tau)" for n in names)]
    rows += [(category,) + tuple(f"{columns[n][i]:.2f}x ({taus[n][i]:.2f})" for n in names)
             for i, category in enumerate(categories)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))


def plot(results: dict, out: Path) -> None:
    """Speedup over baseline and tau, per category."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in results["methods"] if n != "baseline"]
    categories = categories_of(results)
    panels = (["speedup"] if "baseline" in results["methods"] else []) + ["tau"]
    figure, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    width = 0.8 / max(len(names), 1)
    for axis, key in zip(axes[0], panels):
        for i, name in enumerate(names):
            axis.bar([c + i * width for c in range(len(categories))], by_category(results, name, key), width,
                     label=name)
        axis.set_xticks([c + width * (len(names) - 1) / 2 for c in range(len(categories))], categories, rotation=30)
        axis.set_title("speedup over plain mlx-lm decoding" if key == "speedup" else "tau (tokens per target forward)")
        if key == "speedup":
            axis.axhline(1.0, color="gray", linewidth=0.8)
        axis.legend()
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = new_parser("mlx_eagle.bench", __doc__)
    add_model_arguments(parser, tree=False, lookup=False, shards=False)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompts", type=Path, help="a JSONL file: one object a line with \"turns\" (a list of "
                        "user messages) and optionally \"category\"")
    source.add_argument("--suite", choices=["mt-bench"], help="a bundled prompt set: MT-bench's 80 questions")
    parser.add_argument("--max-turns", type=int, help="ask at most this many turns of each prompt")
    parser.add_argument("--limit", type=int, help="only the first N prompts")
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per turn")
    add_sampling_arguments(parser, seed=0)
    add_kv_arguments(parser)
    parser.add_argument("--methods", default="baseline,default",
                        help=f"comma-separated: {', '.join(METHODS)}; default is what the commands do with no "
                             "flags, baseline plain mlx-lm")
    parser.add_argument("--tree", default="auto", help=TREE_HELP)
    parser.add_argument("--draft-model", help="small model for mlx-lm's draft-model speculative decoding")
    parser.add_argument("--num-draft-tokens", type=int, default=3, help="draft tokens a round for mlx-lm's "
                        "draft-model method")
    parser.add_argument("--no-history", action="store_true", help="context drafts draft from the conversation "
                        "alone (by default each method also drafts from its own earlier replies in this run)")
    parser.add_argument("--out", type=Path, help="write results as JSON here")
    parser.add_argument("--plot", type=Path, help="draw speedup and tau per category here (PNG)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise UserError(f"unknown method(s) {unknown or methods}; choose from {', '.join(METHODS)}")
    if "draft-model" in methods and not args.draft_model:
        raise UserError("the draft-model method needs --draft-model (a small model with the same tokenizer)")
    from .costs import weight_format
    from .models import resolve_model
    from .plan import load, plan_drafts, user_drafter
    from .target import kv_quantization
    from .verify import Sampling

    tree = parse_tree(args.tree) if args.tree != "auto" else "auto"
    kv_quantization(**kv_options(args))
    prompts = read_prompts(args.prompts) if args.prompts else mtbench_suite()
    for prompt in prompts:
        prompt.turns = prompt.turns[: args.max_turns] if args.max_turns else prompt.turns
    prompts = prompts[: args.limit] if args.limit else prompts
    user_drafter(args.draft)  # your own drafter, imported now: one line if it cannot be
    model, tokenizer, draft = load(args.model, draft=args.draft)

    def history():  # each method drafts from its own earlier replies, built up as its requests run
        return False if args.no_history else History(model_identity(model))

    chosen = draft if args.draft != "none" else "none"
    kv = kv_options(args)
    plans = {"default": plan_drafts(model, chosen, tree, history=history(), tokenizer=tokenizer, **kv),
             "default-no-history": plan_drafts(model, chosen, tree, history=False, tokenizer=tokenizer, **kv),
             "lookup": plan_drafts(model, "lookup", tree, history=history(), **kv),
             "none": plan_drafts(model, "none", tree, history=False, **kv)}
    if {"drafter", "drafter+lookup"} & set(methods):
        if draft is None:
            raise UserError("no drafter for this model: pass --draft DIR (a head, a DFlash drafter or a draft model; "
                            "see python -m mlx_eagle.train)")
        plans["drafter"] = plan_drafts(model, draft, tree, lookup=False, tokenizer=tokenizer, **kv)
        plans["drafter+lookup"] = plan_drafts(model, draft, tree, lookup=True, history=history(), tokenizer=tokenizer,
                                              **kv)
    sampling = Sampling(args.temp, args.top_p, args.min_p, args.top_k)
    generators: Dict[str, Generator] = {}
    for name in methods:
        if name == "baseline":
            generators[name] = mlx_lm_method(model, tokenizer, args.max_tokens, sampling, args.seed, kv=kv)
        elif name in plans:
            generators[name] = speculative_method(model, tokenizer, plans[name], args.max_tokens, sampling, args.seed,
                                                  kv)
        else:
            draft_model, _ = load(args.draft_model)
            generators[name] = mlx_lm_method(model, tokenizer, args.max_tokens, sampling, args.seed, draft_model,
                                             args.num_draft_tokens)
    measuring = machine()  # before the run: the code that measures is the code as it starts
    results = run_bench(prompts, tokenizer, generators, greedy=sampling.greedy, progress=not args.quiet)
    results.update(
        machine=measuring, model=str(resolve_model(args.model)), weights=weight_format(model),
        head=str(getattr(draft, "directory", None)) if draft is not None else None, tree=args.tree,
        drafts={name: {"drafts": plans[name].describe(), "notes": plans[name].notes} for name in methods
                if name in plans},
        settings={k: v for k, v in vars(args).items() if k not in ("out", "plot", "quiet")},
        prompt_count=len(prompts),
    )
    print_table(results)
    print_categories(results)
    print_by_request(results)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(args.out, json.dumps(results, indent=2, default=str))
        print(f"wrote {args.out}")
    if args.plot:
        plot(results, args.plot)
        print(f"wrote {args.plot}")


def cli() -> None:
    """Console-script entry point."""
    run_cli(main)


if __name__ == "__main__":
    cli()
