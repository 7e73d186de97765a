#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the whole test suite: reference and API tests, Triton
# kernels in the interpreter, ahead-of-time compilation of every kernel for sm_80/sm_90
# (no spills), nvcc -c of the CUDA sources, and the C++ extension.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python -m pytest -q -p no:cacheprovider tests "$@"
