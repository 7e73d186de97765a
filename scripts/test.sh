#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the whole test suite: reference and API tests, Triton
# kernels in the interpreter, ahead-of-time compilation of a covering sample of the kernel
# configurations for sm_80/sm_90 (errors and A100's shared memory fail it; spills are
# printed), nvcc -c of the CUDA sources, and the C++ extension.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python -m pytest -q -p no:cacheprovider tests "$@"
