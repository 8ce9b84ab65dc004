"""Write benchmarks/prompts/edit.jsonl: edit-style prompts whose answers copy from the prompt.

    python benchmarks/edit_prompts.py [--out benchmarks/prompts/edit.jsonl]

Chosen by rule, not by hand: the first four ShareGPT first turns (file order, 200 to
1,500 characters, MT-bench removed) that start with a verb of each kind (rewrite, fix,
reformat, code edit: a rewrite/convert/refactor/translate request holding code), and
four MT-bench extraction questions that quote the text to extract from.
"""

import argparse
import json
import re
from pathlib import Path
from typing import List, Optional

from mlx_eagle.data import mtbench_questions, sharegpt_prompts

KINDS = {
    "rewrite": r"(please )?(rewrite|paraphrase|proofread|correct)\b",
    "fix": r"(please )?(fix|debug|correct|find the (bug|error))\b",
    "reformat": r"(please )?(format|reformat|convert)\b",
    "code-edit": r"(please )?(rewrite|refactor|convert|translate)\b",
}
CODE = re.compile(r"\b(def|function|public|const|import|return)\b.*[\n{(]")
PER_KIND = 4
EXTRACTION = (131, 133, 135, 137, 139, 140)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "prompts" / "edit.jsonl")
    out = parser.parse_args(argv).out
    chosen = {kind: [] for kind in KINDS}
    seen = set()
    for prompt in sharegpt_prompts():
        text = prompt.strip()
        if not 200 <= len(text) <= 1500 or text[:60] in seen:
            continue
        has_code = bool(CODE.search(text))
        for kind, pattern in KINDS.items():
            wanted = len(chosen[kind]) < PER_KIND and has_code == (kind in ("fix", "code-edit"))
            if wanted and re.match(pattern, text, re.I):
                chosen[kind].append(text)
                seen.add(text[:60])
                break
    records = [{"id": f"sharegpt-{kind}-{i}", "category": kind, "prompt": text}
               for kind, texts in chosen.items() for i, text in enumerate(texts)]
    questions = {q["question_id"]: q for q in mtbench_questions()}
    records += [{"id": f"mt-bench-{qid}", "category": "extract", "prompt": questions[qid]["turns"][0]}
                for qid in EXTRACTION]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    print(f"wrote {len(records)} prompts to {out}")


if __name__ == "__main__":
    main()
