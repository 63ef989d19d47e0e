#!/usr/bin/env bash
# One full benchmark run (about 20 minutes on 2 cores), then docs/benchmarks.md from its JSON.
# The peer benchmark builds llama-server once into ~/.cache/dgr (about 10-14 minutes, then cached).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench-out}
DGR=.venv/bin/dgr
cmds=(
  "$DGR bench scheduler --out $OUT/scheduler"
  "$DGR bench scale --out $OUT/scale"
  "$DGR bench engine --out $OUT/engine"
  "$DGR bench e2e --model gemma --recipe fast,invariant --out $OUT/e2e-gemma"
  "$DGR bench e2e --model tiny --out $OUT/e2e-tiny"
  "$DGR bench interference --model gemma --out $OUT/interference"
  "$DGR bench peer --out $OUT/peer"
  "$DGR bench producer --out $OUT/producer"
)
for c in "${cmds[@]}"; do echo "== $c"; $c; done
joined=$(printf '%s; ' "${cmds[@]}")
$DGR bench report --root "$OUT" --out docs/benchmarks.md --command "${joined//.venv\/bin\//}"
