#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the main job, in four parts, each printing one table:
#   1. verification: every op on every backend vs the float64 oracle;
#   2. mappings: speed vs entmax 1.3 and softmax;
#   3. attention: time and memory vs scaled_dot_product_attention (+ bench/out/attention.png);
#   4. training: a short associative-recall run with softmax, sparsemax, 1.5-entmax and
#      learned-α attention (+ bench/out/train/attention_heatmaps.png).
# About 4 minutes on an idle 2-core CPU after setup; outputs in bench/out/
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mkdir -p bench/out
part() { printf '\n==================== %s ====================\n' "$1"; }
part "1/4 verification: every op, every backend, vs a float64 oracle (python bench/verify.py)"
python bench/verify.py
part "2/4 mappings: speed vs entmax 1.3 and softmax (python bench/bench_mappings.py)"
python bench/bench_mappings.py --csv bench/out/mappings.csv
part "3/4 attention: time and memory vs SDPA (python bench/bench_attention.py)"
python bench/bench_attention.py --batch 2 --heads 8 --head-dim 64 --lengths 256 1024 2048 --out bench/out
part "4/4 training: associative recall, 4 attention kinds (python -m entmax_fast.train --quick)"
# Progress bars only on a terminal: in a log they are one long line of carriage returns.
progress=()
[[ -t 2 ]] || progress=(--no-progress)
python -m entmax_fast.train --quick --out bench/out/train "${progress[@]}"
