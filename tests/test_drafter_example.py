"""README's "Write your own drafter" runs as written, drafts, and gives plain decoding's text."""

import contextlib
import io
import re
from pathlib import Path

from plain import plain_tokens

README = Path(__file__).resolve().parent.parent / "README.md"


def example() -> str:
    section = README.read_text().split("### Write your own drafter", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_drafter_is_short_and_lossless(smollm):
    code = example()
    assert len(code.strip().splitlines()) <= 32  # the drafter itself, 30 lines or fewer, and its use
    namespace = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), namespace)
    model, tokenizer = namespace["model"], namespace["tokenizer"]
    expected = [t for t in plain_tokens(model, namespace["prompt"], 32, tokenizer.eos_token_ids)
                if t not in tokenizer.eos_token_ids]
    assert printed.getvalue() == tokenizer.decode(expected)
    # The phrase drafter alone (no context drafts): its drafts are accepted, the text is the same.
    from mlx_eagle import stream_generate

    drafter = namespace["PhraseDrafter"](tokenizer, [" capital of France is Paris."])
    responses = list(stream_generate(model, tokenizer, namespace["prompt"], draft=drafter, lookup=False,
                                     max_tokens=32))
    assert [r.token for r in responses if r.token not in tokenizer.eos_token_ids] == expected
    assert sum(r.from_draft for r in responses) >= 4, "the phrase was drafted and accepted"
