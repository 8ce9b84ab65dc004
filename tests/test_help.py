"""Every command's --help is parsed before MLX's model code loads: it prints its usage
without importing mlx-lm (or transformers), whose import takes seconds, so --help answers
in well under a second (measured: README's command line section)."""

import os
import subprocess
import sys

import pytest

COMMANDS = ["mlx_eagle.generate", "mlx_eagle.chat", "mlx_eagle.server", "mlx_eagle.bench", "mlx_eagle.tune",
            "mlx_eagle.train", "mlx_eagle.convert", "mlx_eagle.convert.head", "mlx_eagle.convert.export"]
PROBE = """
import runpy, sys
sys.argv = [sys.argv[1], "--help"]
try:
    runpy.run_module(sys.argv[0], run_name="__main__")
except SystemExit as exit_:
    heavy = sorted(m for m in ("mlx_lm", "transformers") if m in sys.modules)
    print("HEAVY", heavy, file=sys.stderr)
    sys.exit(exit_.code)
"""


@pytest.mark.parametrize("command", COMMANDS)
def test_help_loads_no_model_code(command):
    result = subprocess.run([sys.executable, "-c", PROBE, command], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, MLX_EAGLE_NO_OPENBLAS="1"))
    assert result.returncode == 0 and "usage:" in result.stdout, result.stderr[-2000:]
    assert "HEAVY []" in result.stderr, result.stderr[-500:]


class Parsed(Exception):
    pass


def command_parser(command: str, monkeypatch):
    """The argparse parser a command's main builds (caught as it parses, before any work)."""
    import argparse
    import importlib

    caught = []

    def capture(self, *args, **kwargs):
        caught.append(self)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    module = {"mlx_eagle.convert": "mlx_eagle.convert.target", "mlx_eagle.generate": "mlx_eagle.generate.__main__",
              "mlx_eagle.train": "mlx_eagle.train.__main__",
              "mlx_eagle.server": "mlx_eagle.server.__main__"}.get(command, command)
    main = importlib.import_module(module).main
    with pytest.raises(Parsed):
        main([])
    return caught[0]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_has_help_and_the_description_is_whole(command, monkeypatch):
    import argparse

    parser = command_parser(command, monkeypatch)
    missing = [a.option_strings[0] if a.option_strings else a.dest for a in parser._actions
               if not isinstance(a, argparse._HelpAction) and not a.help]
    assert not missing, f"{command}: flags without help: {missing}"
    description = (parser.description or "").strip()
    assert description and description[-1] in ".)`:", f"{command}: the description stops mid-sentence: {description!r}"


def _synopsis_flags(text: str, command: str) -> set:
    """The flags README's (or docs/usage.md's) synopsis block shows for ``command``."""
    import re

    flags, inside = set(), False
    for line in text.splitlines():
        if line.startswith("python -m "):
            inside = line.split()[2] == command
        elif not line.startswith(" "):
            inside = False
        if inside:
            flags |= set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", line.split("#")[0]))
    return flags


@pytest.mark.parametrize("command", COMMANDS)
def test_the_synopses_in_the_docs_match_the_parsers(command, monkeypatch):
    """README's synopsis may leave flags to docs/usage.md, whose synopsis shows them all; a
    flag either shows that the parser does not know is stale."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    parser = command_parser(command, monkeypatch)
    known = {s for a in parser._actions for s in a.option_strings if s.startswith("--")} - {"--help"}
    readme = _synopsis_flags((root / "README.md").read_text(), command)
    usage = _synopsis_flags((root / "docs" / "usage.md").read_text(), command)
    assert readme <= known and usage <= known, f"stale flags: {sorted((readme | usage) - known)}"
    assert known <= usage | readme, f"{command}: flags in no synopsis: {sorted(known - usage - readme)}"


@pytest.mark.parametrize("typo, meant", [("chian:3", "chain"), ("dynamc", "dynamic"), ("statc:default", "static")])
def test_a_tree_typo_gets_a_suggestion(typo, meant):
    from mlx_eagle.errors import UserError
    from mlx_eagle.trees import parse_tree

    with pytest.raises(UserError, match=f"did you mean '{meant}'"):
        parse_tree(typo)


@pytest.mark.parametrize("typo, meant", [("lookp", "lookup"), ("atuo", "auto"), ("nnoe", "none")])
def test_a_draft_typo_gets_a_suggestion(typo, meant, tmp_path, monkeypatch):
    from mlx_eagle.errors import UserError
    from mlx_eagle.plan import load_draft

    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=f"did you mean '{meant}'"):
        load_draft(typo, None)


@pytest.mark.parametrize("word", ["lookup", "none"])
def test_tune_refuses_a_draft_that_has_no_tree_in_one_line(word):
    result = subprocess.run([sys.executable, "-m", "mlx_eagle.tune", "--draft", word], capture_output=True, text=True,
                            timeout=120, env=dict(os.environ, MLX_EAGLE_NO_OPENBLAS="1"))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and "tune builds trees for EAGLE heads" in lines[0], result.stderr
