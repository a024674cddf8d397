#!/usr/bin/env bash
# Regenerate the README's picture: run the default `eldr reproduce` and copy its headline
# plot (task workload: median and p99 TPOT and median TTFT against request rate per
# policy) to docs/img/headline-task.png, with the run's report beside it for reference.
#   bash scripts/readme_figure.sh [REPORT_DIR]     (default: a temporary folder)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-$(mktemp -d)}
.venv/bin/eldr reproduce --out "$OUT"
mkdir -p docs/img
cp "$OUT/main_task.png" docs/img/headline-task.png
echo "readme_figure: docs/img/headline-task.png from $OUT/report.md ($(date -u +%F))"
