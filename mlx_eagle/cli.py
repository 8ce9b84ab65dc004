"""What every command shares: one-line errors, Ctrl-C, and restarting with the fast BLAS
on Linux (blas.py says which BLAS MLX runs on)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Callable, NoReturn, Optional, Sequence

from .blas import find_openblas, openblas_loaded
from .errors import UserError
from .progress import close_bars

DRAFT_HELP = ("what drafts, beside drafts from the context: a drafter's directory (an EAGLE head, a DFlash drafter, "
              "or a draft model: a model directory, .gguf file or Hugging Face repo id with the model's tokenizer); "
              "your own drafter as package.module:Name or an installed mlx_eagle.drafters entry point; 'lookup' "
              "(drafts from the context alone, any mlx-lm model), or 'none' (plain decoding); default (auto): the "
              "model's own drafter (its MTP module, a head shipped for it), if any")
TREE_HELP = ("draft tree: auto (tuned for this device, see mlx_eagle.tune), chain:K, static:default, static:FILE, "
             "dynamic:topk=8,depth=5,tokens=32, none")


class _Help(argparse.HelpFormatter):
    """argparse's help with each flag's default appended where it has one worth saying."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text or default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def new_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """A command's parser: its description is the docstring's first paragraph, whole."""
    description = " ".join(doc.strip().split("\n\n")[0].split())
    return argparse.ArgumentParser(prog=f"python -m {prog}", description=description, formatter_class=_Help)


def add_sampling_arguments(parser: argparse.ArgumentParser, seed: Optional[int] = None, filters: bool = True) -> None:
    """--temp, --top-p (and --top-k, --min-p) and --seed, the same in every command that decodes."""
    parser.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy; below 1e-4 "
                        "counts as greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of tokens whose "
                        "probability reaches P (1: all)")
    if filters:
        parser.add_argument("--top-k", type=int, default=0, help="sample from the K likeliest tokens (0: all)")
        parser.add_argument("--min-p", type=float, default=0.0, help="drop tokens less likely than P times the "
                            "likeliest (0: none)")
    parser.add_argument("--seed", type=int, default=seed, help="random seed for sampling" +
                        ("" if seed is not None else " (default: a fresh one)"))


def add_model_arguments(parser: argparse.ArgumentParser, draft: bool = True, tree: bool = True,
                        lookup: bool = True) -> None:
    """--model, --draft (and --no-lookup) and --tree, the same in every command."""
    parser.add_argument("--model", help="MLX or Hugging Face directory, .gguf file or Hugging Face repo id "
                                        "(default: SmolLM2-135M-Instruct)")
    if draft:
        parser.add_argument("--draft", default="auto", help=DRAFT_HELP)
    if draft and lookup:
        parser.add_argument("--no-lookup", action="store_true", help="no drafts from the context: what --draft "
                            "names drafts alone")
    if tree:
        parser.add_argument("--tree", default="auto", help=TREE_HELP)


def add_history_arguments(parser: argparse.ArgumentParser) -> None:
    """--history FILE and --no-history, the same in every command that answers requests."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--history", metavar="FILE", help="keep the replies that context drafts draft from in FILE "
                       "(0600, capped at 4 MiB, shared safely between processes); default: in memory, this "
                       "process only")
    group.add_argument("--no-history", action="store_true", help="draft from the conversation alone, not from "
                       "earlier replies")


def add_kv_arguments(parser: argparse.ArgumentParser) -> None:
    """--kv-bits, --kv-group-size and --quantized-kv-start, as mlx-lm names them."""
    parser.add_argument("--kv-bits", type=int, help="quantize the KV cache to this many bits (4 or 8; 2, 3, 5, 6 "
                        "too) once it holds --quantized-kv-start tokens (default: not quantized)")
    parser.add_argument("--kv-group-size", type=int, default=64, help="values per quantization group (32, 64, 128)")
    parser.add_argument("--quantized-kv-start", type=int, default=5000, help="tokens the cache holds before it is "
                        "quantized, as mlx-lm's default")


def kv_options(args: argparse.Namespace) -> dict:
    """What the --kv-* flags ask of stream_generate (and Engine)."""
    return {"kv_bits": args.kv_bits, "kv_group_size": args.kv_group_size, "quantized_kv_start": args.quantized_kv_start}


def history_choice(args: argparse.Namespace):
    """What --history / --no-history ask for, as plan_drafts takes it."""
    return False if args.no_history else (args.history or True)


_REEXEC_MARK = "_MLX_EAGLE_BLAS_REEXEC"  # set in a process restarted with OpenBLAS preloaded


def use_fast_blas() -> None:
    """Restart this process with OpenBLAS preloaded when Linux has it.

    MLX's Linux CPU wheel carries a reference BLAS that runs float32 matmuls
    ~30x slower than OpenBLAS; a library can only replace it if it is loaded
    before the process starts, hence the re-exec. Set MLX_EAGLE_NO_OPENBLAS=1
    to keep the bundled one.
    """
    if not sys.platform.startswith("linux") or os.environ.get("MLX_EAGLE_NO_OPENBLAS"):
        return
    if openblas_loaded() or os.environ.get(_REEXEC_MARK):
        return
    library = find_openblas()
    if library is None:
        print(
            "hint: install OpenBLAS (apt-get install libopenblas0-pthread) to make "
            "float32 decoding on this CPU several times faster",
            file=sys.stderr,
        )
        return
    preload = os.environ.get("LD_PRELOAD")
    env = dict(os.environ, _MLX_EAGLE_BLAS_REEXEC="1")
    env["LD_PRELOAD"] = f"{library}:{preload}" if preload else library
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def _terminated(signum, frame) -> None:
    raise SystemExit(128 + signum)


def run_cli(main: Callable[[Optional[Sequence[str]]], None], argv=None) -> NoReturn:
    """Run a command's main: fast BLAS first, then one line per user error. SIGTERM
    becomes an exit that unwinds, so what a command half wrote is cleaned up as on
    Ctrl-C."""
    use_fast_blas()
    signal.signal(signal.SIGTERM, _terminated)
    try:
        main(argv)
    except UserError as error:

        close_bars()  # the error starts a line of its own
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(1)
    sys.exit(0)
