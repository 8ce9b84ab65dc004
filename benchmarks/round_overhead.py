"""What a round costs beyond its forward passes.

1. A tiny llama target (8 layers, width 64, SmolLM2's vocabulary and tokenizer) whose
   forward costs little, with a random EAGLE-3 head (tau ~1), decoded through the public
   stream_generate: time per token against plain mlx_lm.stream_generate, compiled rounds
   against eager ones. Methods alternate within each repeat; the medians are reported.
   And per tree kind, the operations a round dispatches (every graph the round
   evaluates, counted before it runs: the launches that a GPU pays for one by one), on
   this CPU and as a GPU runs them (MLX's fast RoPE, norms and attention one kernel
   each, where this CPU writes them out as their parts), and the host's milliseconds a
   round outside evaluation.
2. SmolLM2-135M-Instruct with the shipped head: where a round's time goes, through the
   decoder's phase hook, each phase timed to the end of its device work: waiting for the
   tree drafted the round before (and any context draft), verifying and accepting it, and
   the drafters observing what was committed (where the head drafts the next tree);
   compiled and eager. And the host's time to build one verify pass's graph.

    python benchmarks/round_overhead.py [--tokens 256] [--repeats 7] [--out benchmarks/results/round-overhead.json]
"""

import argparse
import contextlib
import gc
import io
import json
import re
import statistics
import time
from pathlib import Path
from typing import List, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm import stream_generate as mlx_lm_stream_generate
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from mlx_eagle import load, plan_drafts, stream_generate
from mlx_eagle.compiled import compiling_rounds
from mlx_eagle.cli import use_fast_blas
from mlx_eagle.decoder import PHASES, SpeculativeDecoder
from mlx_eagle.heads import new_head
from mlx_eagle.verify import Sampling

SETTINGS = {  # name: (tree, lookup, compiled: the round's draft and verify passes each one compiled call)
    "none": ("none", False, True),
    "none, eager": ("none", False, False),
    "lookup": ("none", True, True),
    "chain:4": ("chain:4", False, True),
    "chain:4, eager": ("chain:4", False, False),
    "static:default": ("static:default", False, True),
    "static:default, eager": ("static:default", False, False),
    "dynamic": ("dynamic:topk=4,depth=5,tokens=16", False, True),
    "dynamic, eager": ("dynamic:topk=4,depth=5,tokens=16", False, False),
}


_SWITCH = contextlib.ExitStack()


def compile_rounds(compiled: Optional[bool]) -> None:
    """Rounds as compiled calls (the head's read and draft, the verify pass), or eager ones,
    whatever this device's default (read when a round's drafter is made, and each round),
    until the next call; None: as the device decides."""
    _SWITCH.close()
    _SWITCH.enter_context(compiling_rounds(compiled))


def tiny_target(tokenizer, tokens: int, repeats: int) -> dict:
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=8, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=tokenizer.vocab_size, max_position_embeddings=4096,
        tie_word_embeddings=True, rope_theta=10000.0))
    mx.eval(model.parameters())
    head = new_head(model, "eagle3", draft_vocab_size=8192)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a story."}],
                                           add_generation_prompt=True)

    def ours(tree, lookup, compiled):
        def run():
            compile_rounds(compiled)
            return stream_generate(model, tokenizer, prompt, max_tokens=tokens, draft=head, tree=tree, lookup=lookup)
        return run

    methods = {"mlx_lm": lambda: mlx_lm_stream_generate(model, tokenizer, mx.array(prompt), max_tokens=tokens)}
    methods.update({name: ours(*setting) for name, setting in SETTINGS.items()})
    per_token = {name: [] for name in methods}
    for _ in range(repeats + 1):  # the first round of each is a warm-up
        for name, run in methods.items():
            times = []
            tic = time.perf_counter()
            for _response in run():
                times.append(time.perf_counter() - tic)
            # from the first token on: the prompt's reading left out
            per_token[name].append((times[-1] - times[0]) / (len(times) - 1))
    medians = {name: statistics.median(values[1:]) for name, values in per_token.items()}
    result = {name: {"ms_per_token": 1000 * ms, "vs_mlx_lm": ms / medians["mlx_lm"]} for name, ms in medians.items()}
    for name, setting in SETTINGS.items():
        result[name].update(round_profile(model, head, *setting, prompt))
    result["mlx_lm"]["operations_per_round"] = plain_step_operations(model, prompt)
    with one_kernel_fast_ops(model):
        result["mlx_lm"]["gpu_operations_per_round"] = plain_step_operations(model, prompt)
    print(f"{'':22s} {'ms/token':>8s} {'vs mlx_lm':>9s} {'ops/round':>9s} {'GPU ops':>7s} {'host ms':>7s}")
    for name, row in result.items():
        host = f"{row['host_ms_per_round']:7.2f}" if "host_ms_per_round" in row else ""
        print(f"{name:22s} {row['ms_per_token']:8.3f} {row['vs_mlx_lm']:8.2f}x {row['operations_per_round']:9.0f} "
              f"{row['gpu_operations_per_round']:7.0f} {host}")
    return result


def phases_of_a_round(model, head, tree: str, prompt, rounds: int) -> dict:
    """Milliseconds per round in each phase (PHASES, the decoder's own), the device
    drained at each (so the phases do not overlap as they do in decoding: the sum is a
    little more than a real round)."""
    marks = {}

    def mark(phase: str) -> None:
        mx.synchronize()
        marks[phase] = time.perf_counter()

    decoder = SpeculativeDecoder(model, plan_drafts(model, head, tree, lookup=False).drafter(), Sampling(),
                                 on_phase=mark)
    decoder.prefill(prompt)
    spent = {phase: [] for phase in PHASES}
    produced = 0
    for _ in range(rounds):
        mx.synchronize()
        before = time.perf_counter()
        produced += len(decoder.round(64).tokens)
        for phase in PHASES:
            spent[phase].append(marks[phase] - before)
            before = marks[phase]
    row = {phase: 1000 * statistics.mean(times[2:]) for phase, times in spent.items()}
    row["round"] = sum(row.values())
    row["tokens_per_round"] = produced / rounds
    return row


# Primitives that only view their input (no kernel runs for them on a GPU).
VIEWS = {"Broadcast", "BroadcastAxes", "ExpandDims", "Squeeze", "Reshape", "Transpose", "Slice", "AsStrided",
         "StopGradient", "Depends", "Split", "Flatten", "Unflatten"}


def operations(arrays: list) -> int:
    """The operations evaluating ``arrays`` dispatches: the primitives of their pending
    graph (a compiled call's fused kernels count once each), views left out."""
    buffer = io.StringIO()
    mx.export_to_dot(buffer, *arrays)
    return sum(1 for label in re.findall(r'label ="(\w+)"', buffer.getvalue()) if label not in VIEWS)


def plain_step_operations(model, prompt) -> int:
    """The operations one of mlx-lm's plain decoding steps dispatches (its forward and argmax)."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([prompt]), cache=cache))
    return operations([mx.argmax(model(mx.array([prompt[-1:]]), cache=cache)[:, -1], axis=-1)])


@contextlib.contextmanager
def one_kernel_fast_ops(*modules):
    """Graphs built as a GPU would run them: on this CPU, MLX writes mx.fast's RoPE,
    RMSNorm, LayerNorm and attention out as their parts, where Metal and CUDA run each as
    one kernel. Inside, each call is one non-fusable operation of the right shape on the
    same inputs (its values meaningless: for counting only); ``modules``' compiled pieces
    are traced again inside, and again after."""
    def one_kernel(shape, *inputs):
        first = inputs[0]
        out = mx.cumsum(mx.broadcast_to(first.reshape(-1)[:1].reshape((1,) * len(shape)), shape), axis=-1)
        return mx.depends([out], [a for a in inputs if isinstance(a, mx.array)])[0]

    def forget_traces():
        for module in modules:
            for _, child in module.named_modules():
                child.__dict__.pop("_compiled_pieces", None)

    saved = {name: getattr(mx.fast, name) for name in ("rope", "rms_norm", "layer_norm",
                                                        "scaled_dot_product_attention")}
    mx.fast.rope = lambda x, *args, offset=0, freqs=None, **kwargs: one_kernel(x.shape, x, offset, freqs)
    mx.fast.rms_norm = lambda x, weight, eps: one_kernel(x.shape, x, weight)
    mx.fast.layer_norm = lambda x, weight, bias, eps: one_kernel(x.shape, x, weight, bias)
    mx.fast.scaled_dot_product_attention = lambda q, k, v, *, scale, mask=None, sinks=None: one_kernel(
        q.shape[:-1] + (v.shape[-1],), q, k, v, mask, sinks)
    forget_traces()
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(mx.fast, name, function)
        forget_traces()


def round_profile(model, head, tree: str, lookup: bool, compiled: bool, prompt, rounds: int = 20) -> dict:
    """Per round, means after two: the operations it dispatches (drafting, verifying,
    accepting, observing: every graph handed to mx.eval or mx.async_eval, counted before it
    runs), on this CPU and as a GPU would run them (one_kernel_fast_ops); and the host's
    milliseconds outside evaluation, building graphs in Python (median)."""
    def run(hook) -> list:
        compile_rounds(compiled)
        decoder = SpeculativeDecoder(model, plan_drafts(model, head, tree, lookup=lookup).drafter(), Sampling())
        decoder.prefill(prompt)
        originals, per_round = (mx.eval, mx.async_eval), []

        def hooked(evaluate):
            def call(*args):
                return hook(evaluate, args)
            return call

        try:
            mx.eval, mx.async_eval = hooked(originals[0]), hooked(originals[1])
            for _ in range(rounds):
                hook.spent = 0.0
                tic = time.perf_counter()
                decoder.round(64)
                per_round.append((time.perf_counter() - tic, hook.spent))
        finally:
            mx.eval, mx.async_eval = originals
        return per_round[2:]

    def counting(evaluate, args):
        counting.spent += operations([a for _, a in tree_flatten(list(args)) if isinstance(a, mx.array)])
        return evaluate(*args)

    def timing(evaluate, args):
        tic = time.perf_counter()
        try:
            return evaluate(*args)
        finally:
            timing.spent += time.perf_counter() - tic

    row = {"operations_per_round": statistics.mean(ops for _, ops in run(counting)),
           "host_ms_per_round": 1000 * statistics.median(wall - inside for wall, inside in run(timing))}
    with one_kernel_fast_ops(model, head):
        row["gpu_operations_per_round"] = statistics.mean(ops for _, ops in run(counting))
        row["gpu_host_ms_per_round"] = 1000 * statistics.median(wall - inside for wall, inside in run(timing))
    return row


def verify_build_ms(model, repeats: int = 31) -> dict:
    """Milliseconds the host takes to build one verify pass's graph (5 tokens, a few hundred
    cached), through target_forward and as one compiled call, with nothing evaluated
    in between: the host's share of a round where the device does not evict its caches
    (a GPU's; on this CPU every evaluation streams the weights through them). On this
    CPU's graphs and on graphs as a GPU runs them (one_kernel_fast_ops)."""
    from mlx_eagle.compiled import verify_block
    from mlx_eagle.target import make_cache, target_forward

    cache = make_cache(model)
    mx.eval(target_forward(model, mx.array([list(range(100, 400))]), cache, 0, "causal").logits)
    start, block = cache[0].offset, mx.array([5, 6, 7, 8, 9])
    positions, causal = list(range(start, start + 5)), np.tri(5, dtype=bool)
    build = {"eager": lambda: target_forward(model, block[None], cache, start, "causal"),
             "compiled": lambda: verify_block(model, block, cache, positions, causal)}

    def measure() -> dict:
        for run in build.values():
            mx.eval(run().logits)  # traced once
            for layer_cache in cache:
                layer_cache.trim(5)
        times = {name: [] for name in build}
        gc.disable()  # (a collection inside one timing would be noise)
        try:
            for _ in range(repeats):  # alternating, nothing evaluated until the end
                for name, run in build.items():
                    tic = time.perf_counter()
                    run()
                    times[name].append(1000 * (time.perf_counter() - tic))
                    for layer_cache in cache:
                        layer_cache.trim(5)
        finally:
            gc.enable()
        mx.eval([c.keys for c in cache], [c.values for c in cache])
        return {name: statistics.median(values) for name, values in times.items()}

    result = {"this_cpu_graphs": measure()}
    with one_kernel_fast_ops(model):
        result["gpu_graphs"] = measure()
    for graphs, row in result.items():
        print(f"SmolLM2 verify graph built by the host, {graphs}: eager {row['eager']:.2f} ms, "
              f"compiled {row['compiled']:.2f} ms")
    return result


def smollm2(rounds: int) -> dict:
    model, tokenizer, head = load(draft="auto")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Explain how a hash map works."}],
                                           add_generation_prompt=True)
    result = {}
    for tree in ("chain:1", "chain:4", "static:default"):
        for compiled in (True, False):
            compile_rounds(compiled)
            name = tree if compiled else f"{tree}, eager"
            result[name] = row = phases_of_a_round(model, head, tree, prompt, rounds)
            print(f"SmolLM2 {name:22s} " + "  ".join(f"{k} {v:6.2f}" for k, v in row.items()))
    compile_rounds(None)
    return {"round_ms": result, "verify_build_ms": verify_build_ms(model)}


def main(argv: Optional[List[str]] = None) -> None:
    use_fast_blas()  # as the commands do: timings on MLX's reference BLAS mean nothing
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=40, help="SmolLM2 rounds timed per tree")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "round-overhead.json")
    args = parser.parse_args(argv)
    _, tokenizer = load()
    tiny = tiny_target(tokenizer, args.tokens, args.repeats)
    smollm = smollm2(args.rounds)
    args.out.write_text(json.dumps({"tokens": args.tokens, "repeats": args.repeats, "methods": tiny,
                                    "smollm2_round_ms": smollm["round_ms"],
                                    "smollm2_verify_build_ms": smollm["verify_build_ms"]}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
