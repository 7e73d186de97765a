#!/usr/bin/env bash
# The one GPU check (needs one CUDA GPU, torch with CUDA, triton >= 3.6, pytest; about 6
# minutes from a cold Triton cache). In order, each step logged under $OUT_DIR:
#   1. the Triton tests on CUDA (tests/conftest.py runs the compiled kernels, bf16 too);
#   2. the fused-attention grid (bench/bench_attention_gpu.py: SDPA, entmax_fast α 1.5 / 2,
#      AdaSplash and FlashAttention when importable, random and local inputs);
#   3. the row-wise mappings (bench/bench_rowwise_gpu.py) and, with the extension built for
#      CUDA, fusedmax/oscarmax (bench/bench_structured.py);
#   4. the quick training run on the GPU (python -m entmax_fast.train --quick --device cuda).
# A failing step is reported and the next one runs; the exit status is the number of
# failed steps. QUICK=1 times four cells of the attention grid only.
#
#   bash bench/gpu_check.sh              # outputs in bench/out/gpu
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT_DIR:-bench/out/gpu}"
if ! python -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  echo "gpu_check: needs a CUDA device (none here); nothing run"
  exit 1
fi
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
failed=0

step() {
  local name="$1"; shift
  echo "=== $name: $*"
  local start=$SECONDS
  if "$@" 2>&1 | tee "$OUT_DIR/$name.log"; then
    echo "=== $name: ok ($((SECONDS - start)) s)"
  else
    echo "=== $name: FAILED ($((SECONDS - start)) s), log in $OUT_DIR/$name.log"
    failed=$((failed + 1))
  fi
}

python - <<'PY' | tee "$OUT_DIR/device.txt"
import datetime, importlib.metadata, subprocess, torch
versions = []
for package in ("torch", "triton", "adasplash", "flash-attn", "entmax", "transformers"):
    try:
        versions.append(f"{package} {importlib.metadata.version(package)}")
    except importlib.metadata.PackageNotFoundError:
        pass
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
print(f"{datetime.date.today()} {torch.cuda.get_device_name()} (CUDA {torch.version.cuda}); "
      f"{', '.join(versions)}; entmax_fast at {commit or 'unknown commit'}")
PY

step tests python -m pytest -q -p no:cacheprovider -x tests/test_triton_attention.py \
  tests/test_triton_rowwise.py
if [ "${QUICK:-0}" = "1" ]; then
  step attention python bench/bench_attention_gpu.py --quick --out "$OUT_DIR"
else
  step attention python bench/bench_attention_gpu.py --out "$OUT_DIR"
fi
if [ -f bench/bench_rowwise_gpu.py ]; then
  step rowwise python bench/bench_rowwise_gpu.py --out "$OUT_DIR"
fi
if python -c "import torch, entmax_fast._C, sys; sys.exit(not torch._C._dispatch_has_kernel_for_dispatch_key('entmax_fast::fusedmax_forward', 'CUDA'))" 2>/dev/null; then
  step structured python bench/bench_structured.py
fi
step train python -m entmax_fast.train --quick --device cuda --no-progress --out "$OUT_DIR/train"
echo "gpu_check: $failed step(s) failed; outputs in $OUT_DIR"
exit "$failed"
