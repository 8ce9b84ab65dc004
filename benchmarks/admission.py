"""What admitting proposals costs the built-in drafters: SmolLM2 end to end with the
default drafting (the shipped head and context lookup, no earlier replies), every
proposal admitted (drafters/admit.py) and greedy close calls rechecked by one row, against
the same rounds with both switched off: the same prompts, alternating checked, unchecked,
unchecked, checked after one untimed warm-up, time from the request to the last token.
It also counts the positions rechecked alone.

    python benchmarks/admission.py [--limit 6] [--max-tokens 64] [--out benchmarks/results/admission.json]
"""

import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from unittest import mock

import mlx_eagle.decoder as decoder_module
import mlx_eagle.drafters.composite as composite_module
from typing import List, Optional
from mlx_eagle import plan_drafts, stream_generate
from mlx_eagle.bench import edit_and_mtbench

HERE = Path(__file__).resolve().parent


@contextmanager
def unchecked():
    """Proposals handed to the verifier as drafted, and no greedy close calls rechecked."""
    def trusted(drafter, proposal, budget, name=""):
        return proposal if proposal is not None and len(proposal) else None

    with mock.patch.object(decoder_module, "admit_or_warn", trusted), \
            mock.patch.object(composite_module, "admit_or_warn", trusted), \
            mock.patch.object(decoder_module.SpeculativeDecoder, "_tolerance", lambda self: 0.0):
        yield


def measure(model, tokenizer, head, texts, max_tokens: int) -> dict:
    seconds, identical, rechecked, tokens = {True: 0.0, False: 0.0}, True, 0, 0
    for text in texts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        outputs = set()
        for checked in (None, True, False, False, True):  # None: the warm-up
            plan = plan_drafts(model, head, "auto", history=False)
            with unchecked() if checked is False else nullcontext():
                tic = time.perf_counter()
                responses = list(stream_generate(model, tokenizer, ids, max_tokens=max_tokens, draft=plan))
            if checked is not None:
                seconds[checked] += time.perf_counter() - tic
            if checked:
                rechecked, tokens = rechecked + responses[-1].rechecked, tokens + len(responses)
            outputs.add(tuple(r.token for r in responses))
        identical &= len(outputs) == 1
    return {"checked_s": seconds[True], "unchecked_s": seconds[False],
            "checked_vs_unchecked": seconds[True] / seconds[False], "rechecked_positions": rechecked,
            "tokens": tokens, "identical": identical}


def main(argv: Optional[List[str]] = None) -> None:
    edit_and_mtbench(__doc__, HERE / "results" / "admission.json", 6, measure, lambda row: (
        f"checked {row['checked_s']:6.1f} s  unchecked {row['unchecked_s']:6.1f} s  checked/unchecked "
        f"{row['checked_vs_unchecked']:.3f}  rechecked {row['rechecked_positions']} of {row['tokens']} tokens  "
        f"identical text {row['identical']}"), argv)


if __name__ == "__main__":
    main()
