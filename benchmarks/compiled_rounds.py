"""SmolLM2 end to end with the default drafting (the shipped head and context lookup, no
earlier replies), compiled rounds (the static draft one compiled call across depths, the
verify pass one compiled call per bucket of block sizes) against eager ones (drafted depth
by depth, verified layer by layer): the same prompts, alternating compiled, eager, eager,
compiled after one untimed warm-up, time from the request to the last token.

    python benchmarks/compiled_rounds.py [--limit 10] [--max-tokens 64] [--out benchmarks/results/compiled-rounds.json]
"""

import time
from pathlib import Path
from typing import List, Optional

from mlx_eagle import plan_drafts, stream_generate
from mlx_eagle.compiled import compiling_rounds
from mlx_eagle.bench import edit_and_mtbench

HERE = Path(__file__).resolve().parent


def measure(model, tokenizer, head, texts, max_tokens: int) -> dict:
    seconds, taus, identical = {True: 0.0, False: 0.0}, {True: [], False: []}, True
    for text in texts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        outputs = set()
        for compiled in (None, True, False, False, True):  # None: the warm-up
            with compiling_rounds(bool(compiled)):
                plan = plan_drafts(model, head, "auto", history=False)
                tic = time.perf_counter()
                responses = list(stream_generate(model, tokenizer, ids, max_tokens=max_tokens, draft=plan))
            if compiled is not None:
                seconds[compiled] += time.perf_counter() - tic
                taus[compiled].append(responses[-1].tokens_per_forward)
            outputs.add(tuple(r.token for r in responses))
        identical &= len(outputs) == 1
    return {"compiled_s": seconds[True], "eager_s": seconds[False], "compiled_vs_eager": seconds[True] / seconds[False],
            "tau_compiled": sum(taus[True]) / len(taus[True]), "tau_eager": sum(taus[False]) / len(taus[False]),
            "identical": identical}


def main(argv: Optional[List[str]] = None) -> None:
    edit_and_mtbench(__doc__, HERE / "results" / "compiled-rounds.json", 10, measure, lambda row: (
        f"compiled {row['compiled_s']:6.1f} s  eager {row['eager_s']:6.1f} s  compiled/eager "
        f"{row['compiled_vs_eager']:.3f}  tau {row['tau_compiled']:.2f} / {row['tau_eager']:.2f}  "
        f"identical text {row['identical']}"), argv)


if __name__ == "__main__":
    main()
