"""What a round costs beyond its forward passes: a tiny llama target (8 layers, width 64,
SmolLM2's vocabulary and tokenizer) whose forward costs almost nothing, with a random
EAGLE-3 head (tau ~1), decoded through the public stream_generate, time per token
against plain mlx_lm.stream_generate.

    python results/round_overhead.py [--tokens 256] [--repeats 5] [--out results/round-overhead.json]

Methods alternate within each repeat; the medians are reported.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import stream_generate as mlx_lm_stream_generate
from mlx_lm.models import llama

from mlx_eagle import load, stream_generate
from mlx_eagle.heads import new_head

SETTINGS = {  # name: (tree, lookup)
    "none": ("none", False),
    "lookup": ("none", True),
    "chain:4": ("chain:4", False),
    "static:default": ("static:default", False),
    "dynamic": ("dynamic:topk=4,depth=5,tokens=16", False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("round-overhead.json"))
    args = parser.parse_args()

    _, tokenizer = load()
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=8, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=tokenizer.vocab_size, max_position_embeddings=4096,
        tie_word_embeddings=True, rope_theta=10000.0))
    mx.eval(model.parameters())
    head = new_head(model, "eagle3", draft_vocab_size=8192)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a story."}],
                                           add_generation_prompt=True)

    def ours(tree, lookup):
        return lambda: stream_generate(model, tokenizer, prompt, max_tokens=args.tokens, draft=head, tree=tree,
                                       lookup=lookup)

    methods = {"mlx_lm": lambda: mlx_lm_stream_generate(model, tokenizer, mx.array(prompt), max_tokens=args.tokens)}
    methods.update({name: ours(*setting) for name, setting in SETTINGS.items()})
    per_token = {name: [] for name in methods}
    for _ in range(args.repeats + 1):  # the first round of each is a warm-up
        for name, run in methods.items():
            times = []
            tic = time.perf_counter()
            for _response in run():
                times.append(time.perf_counter() - tic)
            # from the first token on: the prompt's reading left out
            per_token[name].append((times[-1] - times[0]) / (len(times) - 1))
    medians = {name: statistics.median(values[1:]) for name, values in per_token.items()}
    result = {name: {"ms_per_token": 1000 * ms, "vs_mlx_lm": ms / medians["mlx_lm"]} for name, ms in medians.items()}
    for name, row in result.items():
        print(f"{name:16s} {row['ms_per_token']:7.3f} ms/token  {row['vs_mlx_lm']:.2f}x mlx_lm")
    args.out.write_text(json.dumps({"tokens": args.tokens, "repeats": args.repeats, "methods": result}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
