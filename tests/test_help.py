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
