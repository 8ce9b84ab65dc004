"""What verifying several conversations in one forward pass buys on this device: B prompts
(edit-style and MT-bench first turns, alternating) answered by batch_generate with default
drafting, by the same drafting one prompt after another (stream_generate), and by mlx-lm's
own batch_generate (plain batching, no speculation), for each batch size B; and, batched,
with ``--draft none`` (plain batching, ours) and with the drafters backed by a model (heads,
draft models, DFlash and DSpark) drafting one conversation after another (the lever of
drafting the batch together turned off: their ``observe_together`` as the Drafter
default). ``--model`` and ``--draft`` as for mlx_eagle.generate (default: the default
model, drafting as by default). Our batched methods run ``--repeats`` times,
alternating, and report their mean. Reports each method's aggregate tokens/s and its ratio
to mlx-lm's, whether every batched text is the one in turn (plain decoding's), and whether
mlx-lm's batched texts are too.

    python benchmarks/batch_generate.py [--sizes 1,2,4,8] [--max-tokens 64] [--repeats 2] [--out FILE.json]
        [--model MODEL] [--draft DRAFT]
"""

import argparse
import json
import time
from pathlib import Path
from typing import List, Optional

from levers import lever_off

from mlx_eagle.cli import use_fast_blas

HERE = Path(__file__).resolve().parent


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,2,4,8", help="batch sizes, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each batched method, alternating")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "batch-generate.json")
    parser.add_argument("--model", help="the target (default: the default model)")
    parser.add_argument("--draft", default="auto", help="the drafting, as mlx_eagle.generate's --draft")
    args = parser.parse_args(argv)
    use_fast_blas()
    from mlx_lm import batch_generate as mlx_lm_batch_generate

    from mlx_eagle import batch_generate, load, stream_generate
    from mlx_eagle.plan import load_draft
    from mlx_eagle.bench import first_turns
    from mlx_eagle.replies import chat_tokens

    model, tokenizer = load(args.model) if args.model else load()
    sizes = [int(size) for size in args.sizes.split(",")]
    sets = first_turns(HERE / "prompts" / "edit.jsonl", max(sizes))
    texts = [text for pair in zip(sets["edit"], sets["mt-bench"]) for text in pair]
    prompts = [chat_tokens(tokenizer, [{"role": "user", "content": text}]) for text in texts]
    # (a drafter loaded once, as a server holds it)
    draft = args.draft if args.draft in ("none", "lookup") else load_draft(args.draft, model)
    batch_generate(model, tokenizer, prompts[:1], max_tokens=4, draft=draft)  # (timings and trees made once)

    def ours(batch, drafting=draft):
        return batch_generate(model, tokenizer, batch, max_tokens=args.max_tokens, draft=drafting).texts

    def drafters_row_by_row(batch):
        with lever_off("rows"):  # (for this run only)
            return ours(batch)

    def in_turn(batch):
        return ["".join(r.text for r in stream_generate(model, tokenizer, ids, max_tokens=args.max_tokens,
                                                        draft=draft, history=False)) for ids in batch]

    def mlx_lm(batch):
        return mlx_lm_batch_generate(model, tokenizer, batch, max_tokens=args.max_tokens).texts

    def timed(method, batch):
        tic = time.perf_counter()
        answers = method(batch)
        seconds = time.perf_counter() - tic
        tokens = sum(len(tokenizer.encode(answer, add_special_tokens=False)) for answer in answers)
        return {"seconds": seconds, "tokens_per_s": tokens / seconds, "texts": answers}

    batched = {"ours, batched": ours, "ours, batched, --draft none": lambda batch: ours(batch, "none"),
               "ours, batched, drafters row by row": drafters_row_by_row}
    rows = []
    for size in sizes:
        batch, row = prompts[:size], {"batch": size}
        row["mlx_lm batch_generate"] = timed(mlx_lm, batch)
        row["ours, in turn"] = timed(in_turn, batch)
        runs = {name: [] for name in batched}
        for _ in range(args.repeats):
            for name, method in batched.items():
                runs[name].append(timed(method, batch))
        for name, done in runs.items():
            row[name] = {"seconds": [run["seconds"] for run in done],
                         "tokens_per_s": sum(run["tokens_per_s"] for run in done) / len(done),
                         "texts": done[0]["texts"]}
            row.setdefault("identical", True)
            row["identical"] &= all(run["texts"] == row["ours, in turn"]["texts"] for run in done)
        base = row["mlx_lm batch_generate"]
        # ours in turn is plain decoding's text (the suite checks it); mlx-lm's batches may round otherwise
        row["mlx_lm_batch_identical"] = base["texts"] == row["ours, in turn"]["texts"]
        for name in ["ours, in turn", *batched]:
            row[name]["vs_mlx_lm"] = row[name]["tokens_per_s"] / base["tokens_per_s"]
        print(f"B={size:2}  mlx-lm {base['tokens_per_s']:6.1f} tok/s   "
              + "   ".join(f"{name} {row[name]['vs_mlx_lm']:.2f}x" for name in ["ours, in turn", *batched])
              + f"   identical {row['identical']} (mlx-lm's batch: {row['mlx_lm_batch_identical']})", flush=True)
        rows.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"model": args.model, "draft": args.draft, "max_tokens": args.max_tokens, "repeats": args.repeats,
              "rows": rows}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
