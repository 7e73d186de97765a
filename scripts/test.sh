#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the whole test suite: reference and API tests, Triton
# kernels in the interpreter, ahead-of-time compilation of a covering sample of the kernel
# configurations for sm_80/sm_90 (errors and A100's shared memory fail it; spills are
# printed), nvcc -c of the CUDA sources, and the C++ extension. The tests run in one
# pytest-xdist worker per core (TEST_WORKERS sets another count; 0 runs them in this
# process); the ahead-of-time compiles run in one worker, first, in parallel processes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
workers=(-n "${TEST_WORKERS:-auto}" --dist loadgroup)
[[ "${TEST_WORKERS:-auto}" == 0 ]] && workers=()
python -m pytest -q -p no:cacheprovider "${workers[@]}" tests "$@"
