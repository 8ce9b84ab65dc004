"""What every command shares: one-line errors, Ctrl-C, and restarting with the fast BLAS
on Linux (blas.py says which BLAS MLX runs on)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from typing import Callable, NoReturn, Optional, Sequence

from .blas import find_openblas, openblas_loaded
from .errors import UserError
from .files import check_history_file
from .progress import close_bars

DRAFT_HELP = ("what drafts, beside drafts from the context: a drafter's directory (an EAGLE head, a DSpark or DFlash "
              "drafter, "
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
                        lookup: bool = True, shards: bool = True) -> None:
    """--model, --draft (and --no-lookup), --tree and --pipeline (``shards``: the command
    shards the model under mlx.launch), the same in every command."""
    parser.add_argument("--model", help="MLX or Hugging Face directory, .gguf file or Hugging Face repo id "
                                        "(default: SmolLM2-135M-Instruct)")
    if draft:
        parser.add_argument("--draft", default="auto", help=DRAFT_HELP)
    if draft and lookup:
        parser.add_argument("--no-lookup", action="store_true", help="no drafts from the context: what --draft "
                            "names drafts alone")
    if tree:
        parser.add_argument("--tree", default="auto", help=TREE_HELP)
    if shards:
        parser.add_argument("--pipeline", action="store_true", help="under mlx.launch: split the model by layers over "
                        "the ranks (default: each layer by heads)")


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
    parser.add_argument("--quantized-kv-start", type=int, help="with --kv-bits: tokens the cache holds before it is "
                        "quantized (default 5000, as mlx-lm's)")


def kv_options(args: argparse.Namespace) -> dict:
    """What the --kv-* flags ask of stream_generate (and Engine)."""
    return {"kv_bits": args.kv_bits, "kv_group_size": args.kv_group_size, "quantized_kv_start": args.quantized_kv_start}


def history_choice(args: argparse.Namespace):
    """What --history / --no-history ask for, as plan_drafts takes it; a file that cannot
    hold a history (or is some other file) is one line, before the model loads."""
    if args.no_history:
        return False
    return str(check_history_file(args.history)) if args.history else True


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


class _ErrorsOnly:
    """A stream that passes on only lines starting "error:" (another rank's standard error:
    rank 0 speaks for all of them)."""

    def __init__(self, stream):
        self.stream, self.line = stream, ""

    def write(self, text: str) -> int:
        self.line += text
        *lines, self.line = self.line.split("\n")
        for line in lines:
            if line.startswith("error:"):
                self.stream.write(line + "\n")
                self.stream.flush()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False


# Under mlx.launch, each process's rank (mlx.launch sets MLX_RANK; read here, before MLX loads).
LAUNCHED = "MLX_RANK" in os.environ
RANK = int(os.environ.get("MLX_RANK", "0") or 0)


_SAID = threading.Lock()


def _last_word(line: str) -> None:
    """Print a rank's closing line, once: its connection may break as mlx.launch stops it."""
    if _SAID.acquire(blocking=False):
        print(line, file=sys.stderr, flush=True)
    else:
        threading.Event().wait()  # the other thread says it and ends the process


def _stop_when_launch_stops() -> None:
    """End this rank at once when mlx.launch stops it (SIGTERM: another rank ended), or
    when mlx.launch is gone. A Python handler runs on the main thread, which may wait in a
    collective for ever; the signal's number, written to a pipe as it arrives, wakes a
    thread that can end it."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    signal.set_wakeup_fd(write)

    def wait() -> None:
        while signal.SIGTERM not in os.read(read, 64):
            pass
        if RANK == 0:
            _last_word("\nerror: rank 0 was stopped by mlx.launch: another rank ended; every rank stops")
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=wait, daemon=True).start()

    def orphaned() -> None:  # mlx.launch itself was killed: nothing will stop this rank, which would poll for ever
        launcher = os.getppid()
        while os.getppid() == launcher:
            time.sleep(1)
        os._exit(1)

    threading.Thread(target=orphaned, daemon=True).start()


# Seconds a rank other than 0 waits before it reports an error of its own: where rank 0 met the
# same error (a bad argument), rank 0 says it and mlx.launch stops this rank meanwhile.
ECHO_WAIT = 2.0


def run_cli(main: Callable[[Optional[Sequence[str]]], None], argv=None) -> NoReturn:
    """Run a command's main: fast BLAS first, then one line per user error. SIGTERM
    becomes an exit that unwinds, so what a command half wrote is cleaned up as on
    Ctrl-C. Under mlx.launch only rank 0 prints, but for an error no other rank met; a
    rank that lost its connection to the others ends with one line."""
    use_fast_blas()
    if LAUNCHED:
        _stop_when_launch_stops()
    else:
        signal.signal(signal.SIGTERM, _terminated)
    if RANK:
        sys.stdout, sys.stderr = open(os.devnull, "w"), _ErrorsOnly(sys.stderr)
    try:
        main(argv)
    except UserError as error:
        if RANK:
            if error.shared:  # every rank found it; rank 0 says it
                sys.exit(1)
            time.sleep(ECHO_WAIT)
        close_bars()  # the error starts a line of its own
        print(f"error: {f'rank {RANK}: ' if RANK else ''}{error}", file=sys.stderr)
        sys.exit(1)
    except RuntimeError as error:
        if not str(error).startswith(("[ring]", "[jaccl]", "[mpi]", "[nccl]")):
            raise
        close_bars()
        _last_word(f"error: rank {RANK} lost its connection to the other ranks ({error}): one of them ended; "
                   "every rank stops")
        os._exit(1)  # (not sys.exit: tearing down a broken ring can wait for ever)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(1)
    sys.exit(0)
