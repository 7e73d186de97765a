#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the main job: the verification table (every op on
# every backend vs the float64 oracle), the benchmark tables (mappings vs entmax 1.3 and
# softmax; attention vs scaled_dot_product_attention, with a plot), and a short training
# run comparing softmax, sparsemax, 1.5-entmax and learned-α attention.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mkdir -p bench/out
python bench/verify.py
python bench/bench_mappings.py --csv bench/out/mappings.csv
python bench/bench_attention.py --batch 2 --heads 8 --head-dim 64 --lengths 256 1024 2048 --out bench/out
python -m entmax_fast.train --quick --out bench/out/train
