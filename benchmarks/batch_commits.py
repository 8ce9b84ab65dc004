"""batch_generate at an earlier commit against this checkout, in one process so that the
machine's drift between runs falls on both alike: the earlier commit's package is copied
in under another name (its imports are relative), and for each batch size the earlier
default, this default and this ``--draft none`` run in rotating order, ``--repeats`` times
each. B prompts (edit-style and MT-bench first turns, alternating), greedy. Reports each
method's mean tokens/s, the ratios, the forward passes each took, and whether every text
was the same. ``--model`` and ``--draft`` as for mlx_eagle.generate (a draft model is loaded
once and handed to both commits as a model).

    git worktree add /tmp/old <commit>
    python benchmarks/batch_commits.py --old /tmp/old [--sizes 2,4,8,16] [--repeats 3]
        [--max-tokens 64] [--out benchmarks/results/batch-commits.json] [--model MODEL] [--draft DRAFT]
"""

import argparse
import importlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

from mlx_eagle.cli import use_fast_blas

HERE = Path(__file__).resolve().parent
METHODS = ("earlier", "this", "this, --draft none")


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, required=True, help="a checkout of the earlier commit")
    parser.add_argument("--sizes", default="2,4,8,16", help="batch sizes, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "batch-commits.json")
    parser.add_argument("--model", help="the target (default: the default model)")
    parser.add_argument("--draft", default="auto", help="the drafting, as mlx_eagle.generate's --draft")
    args = parser.parse_args(argv)
    if not (args.old / "mlx_eagle" / "__init__.py").exists():
        sys.exit(f"error: --old {args.old}: no mlx_eagle package there; give a checkout of the earlier commit")
    use_fast_blas()
    copy = Path(tempfile.mkdtemp())
    shutil.copytree(args.old / "mlx_eagle", copy / "mlx_eagle_earlier")
    sys.path.insert(0, str(copy))
    earlier = importlib.import_module("mlx_eagle_earlier")

    import mlx_eagle
    from mlx_eagle.bench import first_turns
    from mlx_eagle.replies import chat_tokens

    model, tokenizer = mlx_eagle.load(args.model) if args.model else mlx_eagle.load()
    draft = args.draft if args.draft in ("auto", "none", "lookup") else mlx_eagle.load(args.draft)[0]
    sizes = [int(size) for size in args.sizes.split(",")]
    sets = first_turns(HERE / "prompts" / "edit.jsonl", max(sizes))
    texts = [text for pair in zip(sets["edit"], sets["mt-bench"]) for text in pair]
    prompts = [chat_tokens(tokenizer, [{"role": "user", "content": text}]) for text in texts]
    runs = {"earlier": lambda batch: earlier.batch_generate(model, tokenizer, batch, max_tokens=args.max_tokens,
                                                            draft=draft),
            "this": lambda batch: mlx_eagle.batch_generate(model, tokenizer, batch, max_tokens=args.max_tokens,
                                                           draft=draft),
            "this, --draft none": lambda batch: mlx_eagle.batch_generate(model, tokenizer, batch,
                                                                          max_tokens=args.max_tokens, draft="none")}
    for run in runs.values():  # (timings and trees made once, before any is timed)
        run(prompts[:2])
    rows = []
    for size in sizes:
        done = {name: [] for name in METHODS}
        for repeat in range(args.repeats):
            for name in METHODS[repeat % 3:] + METHODS[:repeat % 3]:
                tic = time.perf_counter()
                reply = runs[name](prompts[:size])
                seconds = time.perf_counter() - tic
                tokens = sum(len(tokenizer.encode(text, add_special_tokens=False)) for text in reply.texts)
                done[name].append({"tokens_per_s": tokens / seconds, "forwards": reply.forwards, "texts": reply.texts})
        row = {"batch": size, "identical": len({json.dumps(r["texts"]) for runs_ in done.values() for r in runs_}) == 1}
        for name, results in done.items():
            row[name] = {"tokens_per_s": statistics.mean(r["tokens_per_s"] for r in results),
                         "each": [r["tokens_per_s"] for r in results], "forwards": [r["forwards"] for r in results]}
        this, plain, before = (row[name]["tokens_per_s"] for name in ("this", "this, --draft none", "earlier"))
        row["this_vs_earlier"], row["this_vs_draft_none"] = this / before, this / plain
        print(f"B={size:2}  earlier {before:5.1f}  this {this:5.1f}  --draft none {plain:5.1f} tok/s   "
              f"this/earlier {this / before:.2f}  this/none {this / plain:.2f}   identical {row['identical']}",
              flush=True)
        rows.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"old": str(args.old), "model": args.model, "draft": args.draft,
                                    "max_tokens": args.max_tokens, "repeats": args.repeats,
                                    "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
