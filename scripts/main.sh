#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the main job: the verification table (every op on
# every backend vs the float64 oracle), the benchmark tables, and a short training run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mkdir -p bench/out
python bench/verify.py
python bench/bench_mappings.py --csv bench/out/mappings.csv
