#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the main job, in five parts, each printing one table:
#   1. verification: every op on every backend vs the float64 oracle;
#   2. mappings: speed vs entmax 1.3 and softmax;
#   3. attention: time and memory vs scaled_dot_product_attention (+ bench/out/attention.png);
#   4. training: a short associative-recall run with softmax, sparsemax, 1.5-entmax and
#      learned-α attention (+ bench/out/train/attention_heatmaps.png);
#   5. length generalisation: softmax, SSMax, sparsemax, 1.5-entmax, learned α and ASEntmax
#      trained at one length, scored up to 16x longer (docs/length_generalization.md).
# Parts 1-4 took 3.6 minutes on an idle 2-core CPU after setup, part 5 1.7 minutes;
# outputs in bench/out/
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mkdir -p bench/out
part() { printf '\n==================== %s ====================\n' "$1"; }
part "1/5 verification: every op, every backend, vs a float64 oracle (python bench/verify.py)"
python bench/verify.py
part "2/5 mappings: speed vs entmax 1.3 and softmax (python bench/bench_mappings.py)"
python bench/bench_mappings.py --csv bench/out/mappings.csv
part "3/5 attention: time and memory vs SDPA (python bench/bench_attention.py)"
python bench/bench_attention.py --batch 2 --heads 8 --head-dim 64 --lengths 256 1024 2048 --out bench/out
part "4/5 training: associative recall, 4 attention kinds (python -m entmax_fast.train --quick)"
# Progress bars only on a terminal: in a log they are one long line of carriage returns.
progress=()
[[ -t 2 ]] || progress=(--no-progress)
python -m entmax_fast.train --quick --out bench/out/train "${progress[@]}"
part "5/5 length generalisation: 6 attention kinds beyond the training length (python bench/bench_length_generalization.py --quick)"
python bench/bench_length_generalization.py --quick --out bench/out/length_generalization
