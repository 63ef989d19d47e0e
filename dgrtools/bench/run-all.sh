#!/usr/bin/env bash
# One full benchmark run (about 30 minutes on 2 cores), then docs/benchmarks.md from its JSON.
# Every figure issue 15 asks for comes from this run (docs/benchmarks.md, "Goals of issue 15"):
# e2e/raw on Gemma greedy and typical, typical/greedy and top-p/greedy (one run, alternated),
# the sleep engine (2 ms at 8 and 32 sessions, 10 ms at 256), the worker's us per session at
# 64/128/256 (no-arithmetic engine, with a per-stage profile), dgr/llama-server greedy and typical,
# and the tiny model's e2e/raw; each with the overlap on and off where that is the question.
# The peer benchmark builds llama-server once into ~/.cache/dgr (about 10-20 minutes, then cached).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench-out}
DGR=.venv/bin/dgr
cmds=(
  "$DGR bench scheduler --out $OUT/scheduler"
  "$DGR bench scale --sessions 64,128,256 --profile --out $OUT/scale"
  "$DGR bench engine --out $OUT/engine"
  "$DGR bench e2e --model gemma --recipe fast,invariant --out $OUT/e2e-gemma"
  "$DGR bench e2e --model gemma --batches 8 --tokens 64 --repeats 3 --sampling greedy,typical,top-p --out $OUT/e2e-gemma-sampling"
  "$DGR bench e2e --model gemma --batches 8 --tokens 64 --repeats 2 --overlap both --out $OUT/e2e-gemma-overlap"
  "$DGR bench e2e --model tiny --overlap both --out $OUT/e2e-tiny"
  "$DGR bench e2e --engine sleep:2ms --batches 8,32 --tokens 64 --repeats 3 --overlap both --out $OUT/e2e-sleep2ms"
  "$DGR bench e2e --engine sleep:10ms --batches 256 --tokens 512 --repeats 1 --overlap both --out $OUT/e2e-sleep10ms"
  "$DGR bench interference --model gemma --out $OUT/interference"
  "$DGR bench peer --out $OUT/peer"
  "$DGR bench peer --sampling typical --without-no-repack --out $OUT/peer-typical"
  "$DGR bench producer --out $OUT/producer"
)
for c in "${cmds[@]}"; do echo "== $c"; $c; done
joined=$(printf '%s; ' "${cmds[@]}")
$DGR bench report --root "$OUT" --out docs/benchmarks.md --command "${joined//.venv\/bin\//}"
