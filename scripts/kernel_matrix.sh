#!/usr/bin/env bash
# The float-sensitive tests (-m floats) under each kernel path this machine can force, one
# after another; prints a Markdown table of the outcomes (docs/testing.md).
#   bash scripts/kernel_matrix.sh [PYTEST ARGS...]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
NPY_ALL=$("$PY" -c 'from numpy._core._multiarray_umath import __cpu_dispatch__ as d; print(" ".join(d))')
SETTINGS=(
  ""
  "MKL_ENABLE_INSTRUCTIONS=SSE4_2"
  "MKL_ENABLE_INSTRUCTIONS=AVX2"
  "MKL_CBWR=COMPATIBLE"
  "OPENBLAS_CORETYPE=Prescott"
  "OPENBLAS_CORETYPE=Sandybridge"
  "OPENBLAS_NUM_THREADS=1"
  "OPENBLAS_NUM_THREADS=2"
  "OMP_NUM_THREADS=1"
  "NPY_DISABLE_CPU_FEATURES=$NPY_ALL"
  "ATEN_CPU_CAPABILITY=default"
)
echo "| setting | passed | failed | seconds |"
echo "|---|---|---|---|"
for s in "${SETTINGS[@]}" other_kernels.sh; do
  start=$(date +%s)
  if [ "$s" = other_kernels.sh ]; then
    out=$(bash scripts/other_kernels.sh "$PY" -m pytest -m floats -q -p no:cacheprovider "$@" 2>&1)
    label="scripts/other_kernels.sh (all of its settings)"
  else
    if [ -n "$s" ]; then  # one NAME=VALUE argument: the value may hold spaces
      out=$(env "$s" "$PY" -m pytest -m floats -q -p no:cacheprovider "$@" 2>&1)
    else
      out=$("$PY" -m pytest -m floats -q -p no:cacheprovider "$@" 2>&1)
    fi
    label=${s:-"machine default"}
    case "$s" in NPY_DISABLE_CPU_FEATURES=*) label="NPY_DISABLE_CPU_FEATURES=(every dispatched feature)";; esac
  fi
  summary=$(printf '%s\n' "$out" | tail -1)
  passed=$(printf '%s' "$summary" | grep -o '[0-9]* passed' | cut -d' ' -f1)
  failed=$(printf '%s' "$summary" | grep -o '[0-9]* failed' | cut -d' ' -f1)
  echo "| \`$label\` | ${passed:-0} | ${failed:-0} | $(( $(date +%s) - start )) |"
  printf '%s\n' "$out" | grep '^FAILED' >&2 || true
done
