"""How speculation scales with the target's size: SmolLM2-135M, Qwen2.5-Coder-0.5B and
-1.5B (real weights, float32 on a CPU), each with default settings, and for the 1.5B the
drafters side by side with mlx-lm's own --draft-model.

    python benchmarks/qwen_models.py                 # once: the two Qwen GGUFs
    python benchmarks/scaling.py [--limit 10] [--max-tokens 48] [--out benchmarks/results/scaling.json]

Per target: the verify-cost curve (a forward over k = 1..32 new tokens after 256 cached,
in plain steps) and bench's default method against plain mlx-lm on the edit prompts and
the first MT-bench turns (methods alternating prompt by prompt, identical text checked).
For the 1.5B also: mlx-lm's --draft-model with the 0.5B (3 tokens, its default here), our
draft-model drafter with the 0.5B (merged with context drafts, what --draft 0.5B does), and
context drafts alone, each with its peak memory.
"""

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional

from mlx_eagle.cli import use_fast_blas

HERE = Path(__file__).resolve().parent


def bench(model_path, draft, methods, prompts, limit, max_tokens, draft_model=None) -> dict:
    from mlx_eagle.bench import main as bench_main

    out = Path("/tmp") / f"scaling-{abs(hash((str(model_path), methods, str(prompts)))) % 10**8}.json"
    argv = ["--methods", methods, "--max-tokens", str(max_tokens), "--limit", str(limit), "--out", str(out),
            "--quiet", "--draft", draft]
    argv += ["--model", str(model_path)] if model_path else []
    argv += ["--prompts", str(prompts)] if prompts != "mt-bench" else ["--suite", "mt-bench", "--max-turns", "1"]
    argv += ["--draft-model", str(draft_model)] if draft_model else []
    bench_main(argv)
    return json.loads(out.read_text())


def summary(result: dict) -> dict:
    keep = ("tokens_per_s_median", "tau", "speedup", "decode_speedup", "identical", "peak_memory_gb",
            "acceptance_by_depth")
    return {name: {k: m.get(k) for k in keep} for name, m in result["methods"].items()} | \
        {"drafts": result.get("drafts")}


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf-dir", type=Path, help="where qwen_models.py put the GGUFs")
    parser.add_argument("--limit", type=int, default=10, help="prompts of each set")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--only", nargs="*", help="smollm2, qwen-0.5b, qwen-1.5b")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "scaling.json")
    parser.add_argument("--table", action="store_true", help="print --out's results as a markdown table, and stop")
    args = parser.parse_args(argv)
    if args.table:
        print(table(json.loads(args.out.read_text())))
        return
    use_fast_blas()
    sys.path.insert(0, str(HERE))
    from qwen_models import MODELS, default_dir

    from mlx_eagle.costs import time_forwards
    from mlx_eagle.models import load_target

    gguf = args.gguf_dir or default_dir()
    small, large = gguf / MODELS["0.5b"].name, gguf / MODELS["1.5b"].name
    targets = {"smollm2": None, "qwen-0.5b": small, "qwen-1.5b": large}
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    for name, path in targets.items():
        if args.only and name not in args.only:
            continue
        model, _, _ = load_target(str(path) if path else None)
        curve = time_forwards(model, sizes=(1, 2, 4, 8, 16, 32), repeats=2)
        del model
        row = {"verify_steps": {k: v / curve[1] for k, v in curve.items()}, "verify_ms": curve}
        for prompts in (HERE / "prompts" / "edit.jsonl", "mt-bench"):
            key = "edit" if prompts != "mt-bench" else "mt-bench"
            if name == "qwen-1.5b":
                row[key] = summary(bench(path, str(small), "baseline,draft-model,default,lookup", prompts, args.limit,
                                         args.max_tokens, draft_model=small))
            else:
                row[key] = summary(bench(path, "auto", "baseline,default", prompts, args.limit, args.max_tokens))
            print(name, key, json.dumps(row[key]), flush=True)
        results[name] = row
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")
    print(table(results))


def table(results: dict) -> str:
    """The results as markdown: per target and prompt set, each method's speedup (decode
    speedup), tau and peak memory, and the verify-cost curve."""
    lines = ["| target | verify k = 2 / 4 / 8 / 16 / 32 (plain steps) | prompts | method | speedup (decode) | tau | "
             "peak GB | identical |", "|---|---|---|---|---|---|---|---|"]
    for name, row in results.items():
        steps = {str(k): v for k, v in row["verify_steps"].items()}
        curve = " / ".join(f"{steps[k]:.2f}" for k in ("2", "4", "8", "16", "32") if k in steps)
        for prompts in ("edit", "mt-bench"):
            for method, m in row.get(prompts, {}).items():
                if method == "drafts":
                    continue
                tau = f"{m['tau']:.2f}" if m.get("tau") else "-"
                lines.append(f"| {name} | {curve} | {prompts} | {method} | {m['speedup']:.2f}× "
                             f"({m['decode_speedup']:.2f}×) | {tau} | {m['peak_memory_gb']:.2f} | {m['identical']} |")
                name = curve = ""  # once per target
    return "\n".join(lines)


if __name__ == "__main__":
    main()
