"""Build the static draft tree that decodes fastest on this device, for one head.

    python -m mlx_eagle.tune [--model M] [--draft HEAD] [--max-nodes 64]

1. Costs, measured here: the target's forward pass over k = 1..64 tokens (a round's
   verification; only as far as a tree of --max-nodes reaches), one head step (a tree
   depth), the rest of a round, and plain mlx-lm decoding per token.
2. Acceptance by (depth, rank), estimated on calibration prompts from ShareGPT (the end
   of the file, which training does not reach; never MT-bench): the target answers them
   greedily, the head is unrolled along those answers, and p[d][r] is how often the
   target's token is the head's rank-r choice at depth d + 1 once the path to it is right.
3. The tree: a node (r1, ..., rd) is accepted with probability p[0][r1] * ... * p[d-1][rd]
   (so a child never beats its parent, and the best n nodes always form a tree). For
   each depth limit and size the best nodes are taken; the tree with the most expected
   tokens per second wins, or plain decoding if nothing beats it.
4. The check: the winning tree and plain mlx-lm decode six more ShareGPT prompts in
   turn; unless the tree is measured at least 5% faster, plain decoding is kept.

The result is kept in the user's cache (``~/.cache/mlx-eagle/heads/<head>/trees/<device>.json``,
never inside the head's own directory, which may be a shipped one), and ``--tree auto``
(the default of the commands) uses it on this device.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .bench import mlx_lm_method, speculative_method
from .cli import add_model_arguments, new_parser, run_cli
from .data import sharegpt_prompts
from .errors import UserError
from .files import write_atomically
from .trees import TreeSpec, node_count, parse_tree

if TYPE_CHECKING:  # imported where used, so that --help need not load MLX's model code
    import mlx.nn as nn

    from .costs import Costs
    from .trees import RankPath

VERIFY_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)


def verify_sizes(max_nodes: int) -> Tuple[int, ...]:
    """The VERIFY_SIZES a tree of at most ``max_nodes`` (and its root) is verified within:
    up to the first that holds them all (larger ones are never timed for nothing)."""
    needed = max_nodes + 1
    covering = [k for k in VERIFY_SIZES if k >= needed][:1]
    return tuple(k for k in VERIFY_SIZES if k < needed) + tuple(covering)


# A tuned tree is kept only if it decodes this much faster than plain mlx-lm when run: the
# cost model leaves out host work per round and its timings are noisy, and a tree it
# favours by a few percent can lose in practice.
CONFIRM_MARGIN = 1.05


def confirm_speedup(model: nn.Module, tokenizer, head, paths: List[RankPath], prompts: Sequence[str],
                    max_tokens: int = 64) -> Tuple[float, float]:
    """Decode ``prompts`` greedily with the tree and with plain mlx-lm, alternating;
    returns (tree tokens/s, plain tokens/s), measured."""
    from .plan import plan_drafts
    from .replies import chat_tokens
    from .verify import Sampling

    sampling = Sampling()  # greedy
    plan = plan_drafts(model, head, TreeSpec("static", paths, text="tuned"), lookup=False)
    methods = [speculative_method(model, tokenizer, plan, max_tokens, sampling),
               mlx_lm_method(model, tokenizer, max_tokens, sampling)]
    tokens, seconds = [0, 0], [0.0, 0.0]
    for index, prompt in enumerate(prompts):
        ids = chat_tokens(tokenizer, [{"role": "user", "content": prompt}])
        for m in (index % 2, 1 - index % 2):
            answer = methods[m](list(ids))
            tokens[m] += len(answer.tokens)
            seconds[m] += answer.seconds
    return tokens[0] / seconds[0], tokens[1] / seconds[1]


def measure_costs(model: nn.Module, tokenizer, head, context: int = 256, repeats: int = 5,
                  progress: bool = True, sizes: Sequence[int] = VERIFY_SIZES) -> Costs:
    """Time verification (over ``sizes`` tokens), a draft step, a round's remainder and
    plain decoding here."""
    from mlx_lm import stream_generate

    from .drafters.calibrate import time_draft_step
    from .costs import Costs, median_ms, time_forwards
    from .decoder import SpeculativeDecoder
    from .drafters.eagle import EagleDrafter
    from .verify import Sampling

    verify_ms = time_forwards(model, sizes, context, repeats, head.taps(model.args.num_hidden_layers), progress)
    draft_step_ms = time_draft_step(model, head, context, repeats)

    # A whole round of a one-node chain, less its verification and draft steps.
    prompt = np.random.default_rng(0).integers(100, model.args.vocab_size - 100, size=context).tolist()
    decoder = SpeculativeDecoder(model, EagleDrafter(head, model, parse_tree("chain:1")), Sampling())
    decoder.prefill(prompt)
    round_ms = median_ms(lambda: decoder.round(4), repeats * 2)
    remainder = max(0.0, round_ms - verify_ms[2] - 2 * draft_step_ms)

    times = []
    tic = time.perf_counter()
    for _ in stream_generate(model, tokenizer, mx.array(prompt[:64]), max_tokens=48):
        times.append(time.perf_counter() - tic)
    plain_ms = 1000 * statistics.median(np.diff(times[8:]))
    return Costs(verify_ms, draft_step_ms, remainder, plain_ms)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = new_parser("mlx_eagle.tune", __doc__)
    add_model_arguments(parser, draft=False, tree=False, shards=False)
    parser.add_argument("--draft", default="auto", help="the EAGLE head directory to tune a tree for (default: "
                        "the head shipped for the model)")
    parser.add_argument("--prompts", type=int, default=24, help="calibration prompts")
    parser.add_argument("--confirm", type=int, default=6, help="further prompts the tree is checked on by decoding, "
                        "against plain mlx-lm")
    parser.add_argument("--max-tokens", type=int, default=128, help="answer tokens per calibration prompt")
    parser.add_argument("--max-nodes", type=int, default=64, help="largest tree considered")
    parser.add_argument("--objective", choices=["speed", "tau"], default="speed",
                        help="speed: most tokens/s on this device (saved for --tree auto); "
                             "tau: most tokens per target forward within --max-nodes (written to --out only)")
    parser.add_argument("--out", type=Path, help="also write the tree here (it is always kept for --tree auto in "
                        "the user's cache, never in the head's directory)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.confirm < 1:
        raise UserError("--prompts and --confirm must be 1 or more")
    if not 1 <= args.max_nodes <= 64:
        raise UserError("--max-nodes must be between 1 and 64")
    if args.objective == "tau" and args.out is None:
        raise UserError("--objective tau needs --out FILE (the tree kept for --tree auto is the fastest one)")

    from .drafters.calibrate import TreeChoice, best_tree, save_acceptance, tuned_tree_file, user_head_dir
    from .costs import device_key
    from .drafters import eagle
    from .plan import load, user_drafter
    from .train.evaluate import calibration_pieces, measure_acceptance

    if user_drafter(args.draft) is not None:
        raise UserError(f"--draft {args.draft} is your own drafter, which sizes its trees itself (Budget.cost, "
                        "Proposal.confidence); tune builds trees for EAGLE heads")
    if args.draft in ("lookup", "none"):
        raise UserError(f"--draft {args.draft} drafts no tree; tune builds trees for EAGLE heads: pass a head's "
                        "directory, or leave --draft out for the model's shipped head")
    model, tokenizer, head = load(args.model, draft=args.draft)
    if head is None:
        raise UserError("no EAGLE head for this model: pass --draft DIR")
    if not eagle.accepts(head):
        raise UserError(f"--draft {args.draft} is a draft model, not an EAGLE head: tune builds trees for heads "
                        "(a draft model sizes its chains as it decodes); pass it to generate or bench --draft")
    head_dir = head.directory
    progress = not args.quiet
    # Calibration prompts from the end of ShareGPT (training reads it from the start), and
    # six before them to confirm the speed-up on: in neither training nor calibration.
    available = sharegpt_prompts()
    prompts, confirmation = available[-args.prompts:], available[-args.prompts - args.confirm:-args.prompts]
    pieces = calibration_pieces(model, tokenizer, prompts, args.max_tokens)
    acceptance = measure_acceptance(model, head, pieces)
    # what --tree auto builds trees from on devices nobody tuned
    save_acceptance(user_head_dir(head_dir), acceptance, f"python -m mlx_eagle.tune, {len(pieces)} ShareGPT "
                    "calibration prompts")
    costs = (measure_costs(model, tokenizer, head, progress=progress, sizes=verify_sizes(args.max_nodes))
             if args.objective == "speed" else None)
    choice = best_tree(acceptance, costs, args.max_nodes)
    key = device_key(model)
    measured = None
    if costs is not None and choice.paths:
        measured = confirm_speedup(model, tokenizer, head, choice.paths, confirmation)
        if measured[0] < CONFIRM_MARGIN * measured[1]:
            print(f"the best tree ran at {measured[0]:.1f} tokens/s against {measured[1]:.1f} plain: "
                  "not fast enough, so auto will decode plainly")
            choice = TreeChoice([], 1.0, choice.expected_tokens_per_s, choice.plain_tokens_per_s)
    result = {
        "device": key, "objective": args.objective, "paths": [list(p) for p in choice.paths],
        "expected_tau": choice.expected_tau, "tree_tokens_per_s": choice.expected_tokens_per_s,
        "plain_tokens_per_s": choice.plain_tokens_per_s,
        "measured_tokens_per_s": ({"tree": measured[0], "plain": measured[1]} if measured else None),
        "acceptance_by_depth_and_rank": acceptance.round(4).tolist(),
        "costs_ms": asdict(costs) if costs else None, "calibration_prompts": len(pieces),
    }
    out = args.out or tuned_tree_file(head_dir, key)
    write_atomically(out, json.dumps(result, indent=1))
    depth1 = ", ".join(f"{p:.2f}" for p in acceptance[:, 0])
    print(f"acceptance of the top draft by depth: {depth1}")
    if choice.paths:

        print(f"tree: {node_count(len(choice.paths))}, depth {max(len(p) for p in choice.paths)}, expected tau "
              f"{choice.expected_tau:.2f}" + (f", {choice.expected_tokens_per_s:.1f} tokens/s vs "
                                               f"{choice.plain_tokens_per_s:.1f} plain" if costs else ""))
    elif measured is None:
        print(f"plain decoding is faster on {key}: no tree is expected to beat "
              f"{choice.plain_tokens_per_s:.1f} tokens/s")
    print(f"wrote {out}")


def cli() -> None:
    """Console-script entry point."""
    run_cli(main)


if __name__ == "__main__":
    cli()
