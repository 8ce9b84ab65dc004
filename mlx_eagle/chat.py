"""Chat with a local model in the terminal, EAGLE-accelerated.

    python -m mlx_eagle.chat [--model M] [--draft D] [--system TEXT] [--temp X] [--tree SPEC]

Enter sends; end a line with \\ to continue on the next, or wrap a block in \"\"\".
Ctrl-C stops a reply (the conversation stays), Ctrl-D or /quit leaves.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Optional, Sequence

from .cli import add_history_arguments, add_kv_arguments, add_model_arguments, add_sampling_arguments, history_choice, \
    kv_options, new_parser, run_cli
from .errors import UserError
from .files import cache_dir, write_atomically
from .trees import parse_tree

COMMANDS = """commands:
  /help           this list
  /reset          forget the conversation (the system prompt stays)
  /forget         forget the earlier replies drafts are also made from (and empty --history's file)
  /system TEXT    set the system prompt ('/system' alone clears it)
  /temp X         sampling temperature (0: greedy)
  /tree SPEC      draft tree: auto, chain:K, static:default, static:FILE, dynamic:..., none
  /stats          show or hide the line after each reply
  /save FILE      write the conversation as JSON
  /quit           leave (Ctrl-D too)"""



def history_file() -> Path:
    """The lines typed at the prompt, kept between chats (in the user's cache)."""
    return cache_dir() / "chat_history"


class Terminal:
    """Line input with editing and history (readline), and dim text where it shows."""

    def __init__(self, out=None):
        self.out = out or sys.stdout  # (looked up now: another rank's is replaced at start, cli.py)
        self.styled = self.out.isatty() and os.environ.get("TERM") != "dumb" and "NO_COLOR" not in os.environ
        try:
            import readline
        except ImportError:  # Windows without pyreadline: plain input() still works
            self.readline = None
        else:
            self.readline = readline
            try:
                readline.read_history_file(history_file())
            except OSError:
                pass

    def dim(self, text: str) -> str:
        return f"\x1b[2m{text}\x1b[0m" if self.styled else text

    def say(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def read_message(self) -> str:
        """One message: a line, lines joined by trailing backslashes, or a \"\"\" block."""
        line = input(">>> ")
        if line.strip() == '"""':
            lines = []
            while (line := input("... ")).strip() != '"""':
                lines.append(line)
            return "\n".join(lines)
        lines = []
        while line.endswith("\\"):
            lines.append(line[:-1])
            line = input("... ")
        return "\n".join(lines + [line])

    def save_history(self) -> None:
        if self.readline is not None:
            path = history_file()
            staging = path.with_name(f".{path.name}.{os.getpid()}.partial")
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                self.readline.write_history_file(str(staging))  # readline writes it; renamed whole, as files.py does
                os.replace(staging, path)
            except OSError:
                staging.unlink(missing_ok=True)


def save_conversation(session, path: Path) -> None:
    """The conversation as JSON, all of it or nothing (written beside, then renamed)."""
    data = {"model": session.engine.name, "system": session.system, "messages": session.history}
    write_atomically(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def command(session, terminal: Terminal, text: str, state: dict) -> bool:
    """Run a /command; False when it asks to leave."""
    name, _, argument = text.partition(" ")
    argument = argument.strip()
    if name in ("/quit", "/exit"):
        return False
    if name == "/help":
        terminal.say(COMMANDS)
    elif name == "/reset":
        session.reset()
        terminal.say(terminal.dim("(conversation forgotten)"))
    elif name == "/forget":
        session.engine.clear_history()
        terminal.say(terminal.dim("(earlier replies forgotten)"))
    elif name == "/system":
        session.system = argument or None
        terminal.say(terminal.dim(f"(system prompt {'set' if argument else 'cleared'})"))
    elif name == "/temp":
        try:
            value = float(argument)
            session.options = session.options.but(temp=value)
        except ValueError:  # a UserError is one too
            terminal.say("usage: /temp X, with X >= 0 (0: greedy)")
        else:
            terminal.say(terminal.dim(f"(temperature {value:g})"))
    elif name == "/tree":
        try:
            if argument != "auto":
                parse_tree(argument)
        except UserError as error:
            terminal.say(f"error: {error}")
        else:
            session.tree = argument
            terminal.say(terminal.dim(f"(tree {argument})"))
    elif name == "/stats":
        state["stats"] = not state["stats"]
        terminal.say(terminal.dim(f"(stats {'on' if state['stats'] else 'off'})"))
    elif name == "/save":
        if not argument:
            terminal.say("usage: /save FILE")
        else:
            try:
                save_conversation(session, Path(argument).expanduser())
                terminal.say(terminal.dim(f"(saved to {argument})"))
            except OSError as error:
                terminal.say(f"error: cannot write {argument} ({error.strerror})")
    else:
        terminal.say(f"unknown command {name}; /help lists them")
    return True


def reply(session, terminal: Terminal, text: str, show_stats: bool) -> None:
    """Stream one reply; Ctrl-C stops it and keeps what was shown."""
    chunks = session.send(text)
    try:
        for chunk in chunks:  # a reasoning model's thinking shows dimmed before its answer
            terminal.out.write(terminal.dim(chunk.reasoning) + chunk.text if chunk.reasoning else chunk.text)
            terminal.out.flush()
    except KeyboardInterrupt:
        chunks.close()  # cancels the generation; the worker stops within a round
        terminal.say()
        terminal.say(terminal.dim("(stopped)"))
    else:
        terminal.say()
    if show_stats and session.stats is not None:
        terminal.say(terminal.dim(session.stats.line()))


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser("mlx_eagle.chat", __doc__)
    add_model_arguments(parser)
    parser.add_argument("--system", help="a system prompt")
    add_sampling_arguments(parser, filters=False)
    add_kv_arguments(parser)
    parser.add_argument("--max-tokens", "-m", type=int, default=512, help="longest reply, in tokens")
    add_history_arguments(parser)
    parser.add_argument("--no-stats", action="store_true", help="hide the line after each reply")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    # Ctrl-C stops a reply: the app's own key, also when it was started with SIGINT ignored
    # (a background job of a non-interactive shell inherits that, and Python then keeps it).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from .distributed import rank, sharding
    from .plan import user_drafter
    from .session import ChatSession
    from .target import kv_quantization
    from .options import ReplyOptions

    # What is wrong with the arguments is said before the model loads.
    if args.tree != "auto":
        parse_tree(args.tree)
    ReplyOptions(max_tokens=args.max_tokens, temp=args.temp, top_p=args.top_p, seed=args.seed)
    kv_quantization(**kv_options(args))
    user_drafter(args.draft)  # your own drafter, imported now: one line if it cannot be
    history = history_choice(args)
    terminal = Terminal()
    terminal.say(terminal.dim("loading..."))
    session = ChatSession(args.model, args.draft, system=args.system, tree=args.tree, temp=args.temp,
                          top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed, history=history,
                          lookup=not args.no_lookup, on_notice=lambda text: terminal.say(terminal.dim(f"({text})")),
                          pipeline=args.pipeline, **kv_options(args))
    engine = session.engine
    if rank():  # a sharded model: rank 0 talks to the terminal, this rank does what its engine does
        engine.follow()
        return
    if sharding(engine.model):
        terminal.say(terminal.dim(f"(model {sharding(engine.model)}; Ctrl-C stops showing a reply, which the ranks "
                                  "finish together)"))
    terminal.say(terminal.dim(f"{engine.name}, {engine.drafting}. /help for commands, Ctrl-D to leave."))
    state = {"stats": not args.no_stats}
    try:
        while True:
            try:
                text = terminal.read_message()
            except KeyboardInterrupt:
                terminal.say()
                continue
            except UnicodeDecodeError:
                terminal.say("error: that line is not UTF-8 text; type it again")
                continue
            except EOFError:
                terminal.say()
                break
            if not text.strip():
                continue
            if text.startswith("/"):
                if not command(session, terminal, text.strip(), state):
                    break
                continue
            try:
                reply(session, terminal, text, state["stats"])
            except UserError as error:
                terminal.say(f"error: {error}")
    finally:
        terminal.save_history()
        engine.close()


def cli() -> None:
    """Console-script entry point."""
    run_cli(main)


if __name__ == "__main__":
    cli()
