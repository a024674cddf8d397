#!/usr/bin/env bash
# Run a command on other numeric kernel paths than this machine picks by itself, so a test
# that holds only on one CPU's kernels fails here too (docs/testing.md).
#   bash scripts/other_kernels.sh .venv/bin/python -m pytest -m floats
# What it forces (each can be overridden from the environment; set one to "" to keep the
# machine's own choice):
#   OPENBLAS_CORETYPE=Prescott       numpy's OpenBLAS: the oldest x86-64 kernels instead of
#                                    the ones picked for this CPU (another summation order)
#   MKL_CBWR=COMPATIBLE              torch's MKL: its conditional-numerical-reproducibility
#                                    path, which sums in another order than AVX2 or AVX-512
#   NPY_DISABLE_CPU_FEATURES=<all>   numpy's own SIMD loops (exp, log, sums) fall back to
#                                    the baseline instead of AVX2 / AVX-512 ones
#   OMP_NUM_THREADS=1, OPENBLAS_NUM_THREADS=1   one thread instead of the machine's count
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: $0 COMMAND [ARG...]" >&2; exit 2; }
PY=${PYTHON:-.venv/bin/python}
if [ "$(uname -m)" = x86_64 ]; then
  export OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE-Prescott}
fi
export MKL_CBWR=${MKL_CBWR-COMPATIBLE}
if [ -z "${NPY_DISABLE_CPU_FEATURES+set}" ]; then
  # every feature numpy was built to dispatch to (the baseline cannot be disabled)
  NPY_DISABLE_CPU_FEATURES=$("$PY" -c '
try:
    from numpy._core._multiarray_umath import __cpu_dispatch__ as d
except ImportError:
    d = []
print(" ".join(d))')
  export NPY_DISABLE_CPU_FEATURES
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS-1}
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS-1}
for v in OPENBLAS_CORETYPE MKL_CBWR NPY_DISABLE_CPU_FEATURES OMP_NUM_THREADS OPENBLAS_NUM_THREADS; do
  [ -n "${!v:-}" ] || unset "$v"
  echo "other_kernels: $v=${!v:-(machine default)}" >&2
done
exec "$@"
