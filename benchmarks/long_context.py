"""Speculation over long contexts, with and without quantized KV caches: plain mlx-lm, ours
with ``--draft none`` and ours with default drafting, alternating per prompt, at prompts of
about 512, 2k and 8k tokens (SmolLM2 to its 8k context; Qwen2.5-Coder-0.5B with ``--model``
for 16k and 32k).

    python benchmarks/long_context.py [--model M] [--lengths 512,2048,8192] [--kv none,8,4]
        [--max-tokens 96] [--out benchmarks/results/long-context.json]

Two tasks per length, over this repository's own documentation cut to the length: rewrite
the document's last paragraph fixing typos (a reply that copies the context), and an open
question about it. Each (length, cache) pair is one ``python -m mlx_eagle.bench`` run, so the
three methods alternate under the same machine load; quantized caches start at once
(``--quantized-kv-start 0``; mlx-lm's default, 5000, would leave the shorter prompts
unquantized). This device's costs, at a short and a 2k context, are timed first and kept,
so that no measured reply pays for timing them. Reported per pair: speedup and τ of default
drafting over plain mlx-lm, ours with ``--draft none``, whether the text is identical, peak
memory and MLX's buffer cache after each request, per method.

With ``--cached-prompt`` the prompt is read once, as mlx-lm reads it (its own
``generate_step``, 2,048 tokens at a time), and every method decodes from a copy of that
cache, the way a server's prefix cache serves a long shared context: on this CPU a 16k-token
prompt takes about a quarter of an hour to read, so reading it again for every method
would measure the reading, identical for all of them. Earlier replies are left out there
(``history=False``), so that one task's reply cannot draft another method's. Where this
device's costs hold a curve timed at a long context, a fourth method is default drafting
sized by the short curve alone (``near_curve`` in the row): what sizing drafts by the
context a round attends to changes.
Rows are merged into ``--out`` by model, length, cache setting and mode: a long grid can be
run a part at a time.
"""

import argparse
import copy
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
TASKS = {
    "rewrite": "Rewrite the last paragraph of the document above, fixing any typos. Reply with the paragraph only.",
    "question": "What are the three most important things the document above says? Answer in a few sentences.",
}


def document() -> str:
    """README and docs, paragraph by paragraph: tens of thousands of tokens of real text."""
    parts = [(ROOT / "README.md").read_text()] + [p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))]
    return "\n\n".join(parts)


def cut(text: str, tokenizer, tokens: int) -> str:
    """The first ``tokens`` tokens of ``text``, ended at a paragraph's end where one lies in
    their last tenth."""
    ids = tokenizer.encode(text)
    if len(ids) < tokens:
        raise SystemExit(f"error: the documentation holds only {len(ids)} tokens; cannot build a {tokens}-token prompt")
    head = tokenizer.decode(ids[:tokens])
    end = head.rfind("\n\n")
    return head[:end] if end >= 0.9 * len(head) else head


def prompts_file(tokenizer, length: int, directory: Path, tasks: List[str]) -> Path:
    text = document()
    while len(tokenizer.encode(text)) < length * 1.2:  # a 32k prompt needs the documentation more than once
        text = text + "\n\n" + document()
    body = cut(text, tokenizer, length - 60)
    path = directory / f"long-{length}.jsonl"
    path.write_text("".join(json.dumps({"id": f"{task}-{length}", "category": task, "messages": [
        {"role": "user", "content": f"{body}\n\n{TASKS[task]}"}]}) + "\n" for task in tasks))
    return path


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="as --model takes it (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--lengths", default="512,2048,8192")
    parser.add_argument("--kv", default="none,8,4", help="cache settings: none (unquantized) or bits")
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"of {', '.join(TASKS)}")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--cached-prompt", action="store_true",
                        help="read each prompt once, as mlx-lm does; every method decodes from a copy of that cache "
                             "(and default drafting sized by the short curve alone, where a long one was timed)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "long-context.json")
    args = parser.parse_args(argv)
    tasks = args.tasks.split(",")
    if not set(tasks) <= set(TASKS):
        raise SystemExit(f"error: --tasks takes {', '.join(TASKS)}, not {args.tasks}")
    from mlx_eagle import load
    from mlx_eagle.costs import CALIBRATION_CONTEXT, verify_costs

    model, tokenizer, draft = load(args.model, draft="auto")
    lengths = [int(n) for n in args.lengths.split(",")]
    if max(lengths) > 2 * CALIBRATION_CONTEXT:  # (shorter replies attend to about what the near curve was timed at)
        for kv in args.kv.split(","):  # timed now, once, and kept: never inside a measured reply
            verify_costs(model, kv_setting(None if kv == "none" else int(kv))).measure_long()
    name = args.model or "SmolLM2-135M-Instruct"
    with tempfile.TemporaryDirectory() as scratch:
        for length in lengths:
            prompts = prompts_file(tokenizer, length, Path(scratch), tasks)
            for kv in args.kv.split(","):
                kv_bits = None if kv == "none" else int(kv)
                if args.cached_prompt:
                    print(f"{length} tokens, cache {kv}: the prompt read once", file=sys.stderr, flush=True)
                    row = cached_prompt_row(model, tokenizer, draft, prompts, kv_bits, args.max_tokens)
                else:
                    row = bench_row(prompts, kv, args, Path(scratch) / f"bench-{length}-{kv}.json")
                row.update(model=name, length=length, kv_bits=kv_bits, max_tokens=args.max_tokens,
                           mode="cached prompt" if args.cached_prompt else "whole request")
                print(line(row), flush=True)
                save(args.out, row)  # after every pair: a long run stopped keeps them
    print(f"wrote {args.out}")


def kv_setting(kv_bits: Optional[int]):
    """The quantization every method's cache gets here: from its first entry (mlx-lm's
    ``quantized_kv_start`` 0), so that a prompt's length is what the quantized cache holds."""
    from mlx_eagle.target import kv_quantization

    return kv_quantization(kv_bits, quantized_kv_start=0 if kv_bits is not None else None)


def bench_row(prompts: Path, kv: str, args, out: Path) -> dict:
    """One ``mlx_eagle.bench`` run: the three methods alternating over the prompts, each
    request read and decoded whole."""
    command = [sys.executable, "-m", "mlx_eagle.bench", "--prompts", str(prompts), "--quiet",
               "--methods", "baseline,none,default", "--max-tokens", str(args.max_tokens), "--out", str(out)]
    command += ["--model", args.model] if args.model else []
    command += ["--kv-bits", kv, "--quantized-kv-start", "0"] if kv != "none" else []
    print(" ".join(command[1:]), file=sys.stderr, flush=True)
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    result = json.loads(out.read_text())
    methods = result["methods"]
    return {
        "prompts": [p["id"] for p in result["prompts"]["baseline"]],
        "speedup": methods["default"]["speedup"], "decode_speedup": methods["default"]["decode_speedup"],
        "none_speedup": methods["none"]["speedup"], "tau": methods["default"]["tau"],
        "identical": methods["default"].get("identical"),
        "none_identical": methods["none"].get("identical"),
        "plain_tokens_per_s": methods["baseline"]["tokens_per_s_overall"],
        "peak_memory_gb": {name: m["peak_memory_gb"] for name, m in methods.items()},
        "cache_memory_gb": {name: m["cache_memory_gb"] for name, m in methods.items()},
        "machine": result["machine"],
    }


def cached_prompt_row(model, tokenizer, draft, prompts: Path, kv_bits: Optional[int], max_tokens: int) -> dict:
    """Per prompt: read it once with mlx-lm's own loop (all but its last token), then plain
    mlx-lm, ours ``--draft none`` and ours default each decode from a copy of that cache,
    in an order that rotates from prompt to prompt. A drafter that reads the target's states
    (a head: ``draft``) needs them for the prompt too: there ours reads the prompt once
    itself, and decodes from a copy of its caches and drafters (what a new conversation
    gets from the prefix cache). Times run from the last prompt token's read to the last
    token."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step, maybe_quantize_kv_cache
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_eagle import stream_generate
    from mlx_eagle.bench import machine
    from mlx_eagle.costs import verify_costs
    from mlx_eagle.prompt_cache import PromptCache
    from mlx_eagle.replies import chat_tokens
    from mlx_eagle.target import MLX_LM_PREFILL_STEP

    quantized = {"kv_bits": kv_bits, "quantized_kv_start": 0} if kv_bits else {}
    eos = set(tokenizer.eos_token_ids)

    def plain(ids: List[int], read: PromptCache) -> dict:
        tokens = []
        for token, _ in generate_step(mx.array(ids[-1:]), model, prompt_cache=copy.deepcopy(read.target),
                                      max_tokens=max_tokens, **quantized):
            tokens.append(int(token))
            if tokens[-1] in eos:
                break
        return {"tokens": tokens}

    def ours(chosen):
        def decode(ids: List[int], read: PromptCache) -> dict:
            slot = PromptCache(copy.deepcopy(read.target), list(read.tokens), unread=read.unread,
                               drafter=read.drafter.branch() if read.drafter is not None else None,
                               plan_key=read.plan_key if read.drafter is not None else ())
            responses = list(stream_generate(model, tokenizer, ids, max_tokens=max_tokens, draft=chosen, history=False,
                                             prompt_cache=slot, **quantized))
            return {"tokens": [r.token for r in responses], "tau": responses[-1].tokens_per_forward,
                    "reused": responses[-1].prompt_reused}
        return decode

    def read_as_mlx_lm(ids: List[int]) -> PromptCache:
        """All but the last token, as mlx-lm's generate_step reads a prompt (its chunks, its
        cache turning quantized after one), so that reading the last one gives its text."""
        cache = make_prompt_cache(model)
        for start in range(0, len(ids) - 1, MLX_LM_PREFILL_STEP):
            model(mx.array([ids[start:min(start + MLX_LM_PREFILL_STEP, len(ids) - 1)]]), cache=cache)
            if kv_bits:
                maybe_quantize_kv_cache(cache, 0, 64, kv_bits)
            mx.eval([c.state for c in cache])
        return PromptCache(cache, list(ids))

    def read_as_ours(ids: List[int]) -> PromptCache:
        slot = PromptCache(make_prompt_cache(model))
        for _ in stream_generate(model, tokenizer, ids, max_tokens=1, draft=draft, history=False, prompt_cache=slot,
                                 **quantized):
            pass
        return slot

    def near_curve(decode):
        """Default drafting sized as if the reply attended to a short context (the curve timed
        after 2,048 entries set aside): what sizing drafts by the context changes."""
        def decode_near(ids: List[int], read: PromptCache) -> dict:
            curves.long_verify_ms, long_curve = None, curves.long_verify_ms
            try:
                return decode(ids, read)
            finally:
                curves.long_verify_ms = long_curve
        return decode_near

    costs = verify_costs(model, kv_setting(kv_bits))  # what the plans of ``ours`` share
    curves = costs.quantized or costs  # a quantized cache's from its first entry
    methods = {"baseline": plain, "none": ours("none"), "default": ours(draft)}
    if curves.long_verify_ms is not None:
        methods["default-near"] = near_curve(ours(draft))
    totals: Dict[str, dict] = {name: {"seconds": 0.0, "tokens": 0, "peak": 0.0, "cache": 0.0} for name in methods}
    replies: Dict[str, List[List[int]]] = {name: [] for name in methods}
    taus: Dict[str, List[float]] = {}
    read_seconds, ids_of = [], []
    entries = [json.loads(text) for text in prompts.read_text().splitlines()]
    warm_up = {"id": "warm-up", "messages": [{"role": "user", "content": entries[0]["messages"][0]["content"][-600:]}]}
    for index, entry in enumerate([warm_up] + entries):  # (a first request pays for tracing and compiling)
        ids = chat_tokens(tokenizer, entry["messages"])
        tic = time.perf_counter()
        read = {"baseline": read_as_mlx_lm(ids)}
        read_seconds.append(time.perf_counter() - tic)
        read["none"] = read["baseline"]
        read["default"] = read["default-near"] = read_as_ours(ids) if draft is not None else read["baseline"]
        if entry is warm_up:
            for name, method in methods.items():
                method(ids, read[name])
            read_seconds.pop()
            continue
        ids_of.append(entry["id"])
        names = list(methods)
        for name in names[index % len(names):] + names[:index % len(names)]:
            mx.clear_cache()
            mx.reset_peak_memory()
            tic = time.perf_counter()
            result = methods[name](ids, read[name])
            totals[name]["seconds"] += time.perf_counter() - tic
            totals[name]["tokens"] += len(result["tokens"])
            totals[name]["peak"] = max(totals[name]["peak"], mx.get_peak_memory() / 1e9)
            totals[name]["cache"] = max(totals[name]["cache"], mx.get_cache_memory() / 1e9)
            replies[name].append(result["tokens"])
            if name != "baseline":
                assert result["reused"] == len(ids) - 1, f"{name}: the copied prompt cache was read again"
            if name.startswith("default"):
                taus.setdefault(name, []).append(result["tau"])
    rate = {name: t["tokens"] / t["seconds"] for name, t in totals.items()}
    return {
        "prompts": ids_of, "speedup": rate["default"] / rate["baseline"],
        "decode_speedup": rate["default"] / rate["baseline"], "none_speedup": rate["none"] / rate["baseline"],
        "tau": sum(taus["default"]) / len(taus["default"]), "identical": replies["default"] == replies["baseline"],
        "none_identical": replies["none"] == replies["baseline"], "plain_tokens_per_s": rate["baseline"],
        "prompt_read_seconds": read_seconds,
        "peak_memory_gb": {name: t["peak"] for name, t in totals.items()},
        "cache_memory_gb": {name: t["cache"] for name, t in totals.items()},
        "machine": machine(),
        **({"near_curve": {"speedup": rate["default-near"] / rate["baseline"],
                           "tau": sum(taus["default-near"]) / len(taus["default-near"]),
                           "identical": replies["default-near"] == replies["baseline"]}}
           if "default-near" in rate else {}),
    }


def save(out: Path, row: dict) -> None:
    """``row`` into ``out``'s rows, replacing one of the same model, length, cache setting and mode."""
    def key(r: dict) -> tuple:
        return (r.get("model", "SmolLM2-135M-Instruct"), r["length"], r["kv_bits"], r.get("mode", "whole request"))

    rows = json.loads(out.read_text())["rows"] if out.exists() else []
    rows = [r for r in rows if key(r) != key(row)] + [row]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": sorted(rows, key=lambda r: (key(r)[0], key(r)[3], r["length"],
                                                                  r["kv_bits"] or 99))}, indent=1) + "\n")


def line(row: dict) -> str:
    peak, cache = row["peak_memory_gb"], row["cache_memory_gb"]
    return (f"| {row['length']} | {row['kv_bits'] or 'none'} | {row['plain_tokens_per_s']:.1f} | "
            f"**{row['speedup']:.2f}×** (τ {row['tau']:.2f}) | {row['decode_speedup']:.2f}× | "
            f"{row['none_speedup']:.2f}× | {row['identical']} | "
            f"{peak['baseline']:.2f} / {peak['none']:.2f} / {peak['default']:.2f} | "
            f"{cache['baseline']:.2f} / {cache['none']:.2f} / {cache['default']:.2f} |")


if __name__ == "__main__":
    main()
