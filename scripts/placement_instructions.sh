#!/usr/bin/env bash
# Instructions per session placed (callgrind: the same count in every run, whatever else the host runs), for
# docs/placement.md's cost where timing is too noisy: `dgrtools.bench.fleet --cost`'s fleet (100 workers x 64
# slots, 64 system prompts of 448 tokens, 1,000 sessions of 512 tokens), the garbage collector off, placed 0 and
# 1,000 times; the difference per session, all of it and outside libcrypto (under valgrind, OpenSSL's SHA-256
# runs without the CPU's SHA extensions, so its count is not what the host runs).
# Usage: scripts/placement_instructions.sh [TREE]   (needs valgrind; TREE defaults to this checkout)
set -euo pipefail
tree=$(cd "${1:-$(dirname "$0")/..}" && pwd)
py=${PYTHON:-$tree/.venv/bin/python}
out=$(mktemp -d)
export PYTHONHASHSEED=0 OPENBLAS_NUM_THREADS=1
for k in 0 1000; do
  (cd "$tree" && PYTHONPATH=$tree valgrind --tool=callgrind --callgrind-out-file="$out/$k.out" "$py" -c "
import gc, time
import numpy as np
from dgrtools.bench import fleet as F
from producer import ProducerCore, SessionTemplate
rng = np.random.default_rng(5)
systems = [[int(t) for t in rng.integers(3, F.VOCAB, 448)] for _ in range(64)]
prompts = [systems[i % 64] + [int(t) for t in rng.integers(3, F.VOCAB, 64)] for i in range(1000)]
fleet = F.cost_fleet(100, 64, systems)
key = fleet[0].keys[0]
core = ProducerCore(); core.fleet.load(fleet, time.monotonic())
tm = [SessionTemplate(session_id=f'c-{i}', account_id='bench', keys=(key,)) for i in range(1000)]
gc.collect(); gc.disable()
for a, p in zip(tm[:$k], prompts[:$k]): core.place_loaded(a, p)
" > /dev/null 2> "$out/$k.err")
done
"$py" - "$out" <<'PY'
import re, subprocess, sys
def totals(f):
    text = subprocess.run(["callgrind_annotate", "--threshold=100", f], capture_output=True, text=True).stdout
    every = crypto = 0
    for line in text.splitlines():
        m = re.match(r"\s*([\d,]+) \([^)]*\)\s+\S", line)
        if m and "PROGRAM TOTALS" not in line:
            v = int(m.group(1).replace(",", ""))
            every += v
            crypto += v if "libcrypto" in line else 0
    return every, crypto
(a0, c0), (a1, c1) = totals(sys.argv[1] + "/0.out"), totals(sys.argv[1] + "/1000.out")
print(f"instructions per session placed: {(a1 - a0) / 1000:.0f}, outside libcrypto {((a1 - c1) - (a0 - c0)) / 1000:.0f}")
PY
rm -rf "$out"
