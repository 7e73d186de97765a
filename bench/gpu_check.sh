#!/usr/bin/env bash
# The one GPU check (needs one CUDA GPU, torch with CUDA, triton >= 3.6, pytest; about 6
# minutes from a cold Triton cache). Each step is logged under $OUT_DIR and bounded by its
# own time limit (a step past it is interrupted, reported, and the next one runs).
# The default steps:
#   tests      the Triton tests on CUDA (tests/conftest.py runs the compiled kernels, bf16
#              too) and the tools' tests (tests/test_tools.py: the edited kernels of
#              tools/attention_variants.py among them), in parallel workers when
#              pytest-xdist is installed;
#   train      the quick training run on the GPU (python -m entmax_fast.train --quick
#              --device cuda), with CUDA_LAUNCH_BLOCKING=1 so a failing kernel is named;
#   hf         a Llama-style model (155M parameters, B 4 L 2048, bf16) trained through
#              attn_implementation "sdpa", "entmax" and "sparsemax": ms per step
#              (bench/bench_hf_training.py; HF_ARGS adds to its arguments);
#   attention  the fused-attention grid (bench/bench_attention_gpu.py: SDPA, entmax_fast
#              α 1.5 / 2, AdaSplash and FlashAttention when importable, random and local
#              inputs); QUICK=1 times four cells only; ATTENTION_ARGS replaces the
#              default "--baseline-budget 120" (AdaSplash autotunes for about a minute per
#              shape: past 120 s it is no longer timed);
#   decode     one decoding step against a key/value cache (bench/bench_decode.py --device
#              cuda: the Triton decoding kernels, contiguous and paged, against SDPA on
#              the same cache and the prefill-shaped entmax_attention call), fp16, B 1, 4,
#              16 at 1k to 128k keys; DECODE_ARGS replaces those batches and lengths;
#   rowwise    the row-wise mappings (bench/bench_rowwise_gpu.py);
#   structured fusedmax/oscarmax, when the extension is built for CUDA: the CUDA ops
#              against the float64 reference (tests/test_structured.py -k cuda_ops),
#              then the GPU table of bench/bench_structured.py (--gpu-only: its CPU table is
#              the CPU's figure, timed where the project is built without a GPU).
#   context_parallel  examples/context_parallel.py under torchrun on nccl, one process per
#              GPU: a context-parallel training step's loss against the single process's
#              (with one GPU the group has one rank: the nccl code path, not the split).
# Steps run only when STEPS names them:
#   extension  builds the C++/CUDA extension in place (MAX_JOBS, default 16 jobs), so
#              that the structured step has CUDA kernels to time;
#   sweep      the row-wise tile table's neighbours (bench/bench_rowwise_gpu.py --sweep)
#              at SWEEP_LENGTHS (default "1024 4096");
# and the kernel-development tools (tools/README.md):
#   profile    per-kernel time of a training step and the compiled kernels' resources
#              (tools/profile_attention_gpu.py);
#   tune       a small sweep of the attention tile table (tools/tune_attention.py);
#   masked     the masked forward's launch: 8 warps and 2 stages against 4 warps and 3,
#              fused or split with the threshold launch capped at 128 (the table: split at
#              4 warps up to E 64, fused at 8 above), the causal mask passed as a bool
#              attn_mask (tools/tune_attention.py --mask bool); MASKED_ARGS replaces
#              "--head-dims 64";
#   variants   what each part of a forward pass costs (tools/attention_variants.py:
#              edited copies of the forward kernel compiled in 8 processes, then timed
#              alone); VARIANTS_ARGS picks them (e.g. "--variants kernel cap2 cap3");
#   bwd_variants  the same for the backward (--backward: forward and backward timed, the
#              backward kernels edited); BWD_VARIANTS_ARGS picks them.
# STEPS picks and orders them (default: tests train hf attention decode rowwise structured
# context_parallel). The exit
# status is the number of failed steps. COMPILE_JOBS (default 8) is how many processes the
# attention, rowwise and hf steps compile their kernels in before timing them.
# A caller with a fixed time limit gives DEADLINE, seconds since the epoch, or BUDGET,
# seconds from now: a step's limit is cut to what is left before it (less the 20 s of a cut
# step's grace and a margin for the summary), and a step with under 30 s left is skipped
# and named, so that the call ends with every log and summary.txt written.
# Several calls in one command share a DEADLINE. DRY_RUN=1 prints each step's limit and
# command instead of running it, on any machine (tests/test_gpu_check.py).
#
#   bash bench/gpu_check.sh                           # outputs in bench/out/gpu
#   STEPS="attention profile" QUICK=1 bash bench/gpu_check.sh
#   STEPS="tests variants masked sweep" bash bench/gpu_check.sh   # with the tools' steps
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT_DIR:-bench/out/gpu}"
if [ "${DRY_RUN:-0}" != "1" ] && ! python -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  echo "gpu_check: needs a CUDA device (none here); nothing run"
  exit 1
fi
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
failed=0
if [ -z "${DEADLINE:-}" ] && [ -n "${BUDGET:-}" ]; then
  DEADLINE=$(( $(date +%s) + BUDGET ))
fi

# step NAME SECONDS COMMAND...: runs COMMAND in its own process group, logged to
# $OUT_DIR/NAME.log. At the limit the whole group gets SIGINT (pytest still prints its
# summary), then SIGKILL 20 s later; whatever the step started and left running (pytest-xdist
# workers) is killed when it ends, so that it cannot slow the next step's timings.
step() {
  local name="$1" limit="$2"; shift 2
  if [ -n "${DEADLINE:-}" ]; then
    local left=$(( DEADLINE - $(date +%s) - 30 ))
    if [ "$left" -lt 30 ]; then
      echo "=== $name: skipped (${left} s left before DEADLINE)"
      skipped="${skipped:-}$name "
      return
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  echo "=== $name (limit ${limit} s): $*"
  [ "${DRY_RUN:-0}" = "1" ] && return
  local start=$SECONDS status
  # job control on for one launch: the step gets a process group of its own, and (unlike
  # a plain background job) does not ignore SIGINT
  set -m
  bash -c 'log=$1; shift; "$@" 2>&1 | tee -i "$log"; exit "${PIPESTATUS[0]}"' _ \
    "$OUT_DIR/$name.log" "$@" &
  local group=$!
  set +m
  (sleep "$limit"; kill -INT -- "-$group" 2>/dev/null; sleep 20; kill -KILL -- "-$group" 2>/dev/null) &
  local watchdog=$!
  wait "$group"
  status=$?
  kill "$watchdog" 2>/dev/null
  kill -KILL -- "-$group" 2>/dev/null
  if [ "$status" -eq 0 ]; then
    echo "=== $name: ok ($((SECONDS - start)) s)"
  else
    echo "=== $name: FAILED or cut off (status $status, $((SECONDS - start)) s), log in $OUT_DIR/$name.log"
    failed=$((failed + 1))
  fi
}

[ "${DRY_RUN:-0}" = "1" ] || python - <<'PY' | tee "$OUT_DIR/device.txt"
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

# the attention, rowwise and hf steps compile their kernels first in this many processes
# at once (a cold Triton cache otherwise spends their limits compiling, one kernel after
# the other); the variants steps take 8, tune the --jobs of its TUNE_ARGS
compile_jobs="${COMPILE_JOBS:-8}"
workers=()
if python -c "import xdist" 2>/dev/null; then
  workers=(-n "${TEST_WORKERS:-8}")
fi
has_cuda_extension() {
  python -c "import torch, entmax_fast._C, sys; sys.exit(not torch._C._dispatch_has_kernel_for_dispatch_key('entmax_fast::fusedmax_forward', 'CUDA'))" 2>/dev/null
}

for name in ${STEPS:-tests train hf attention decode rowwise structured context_parallel}; do
  case "$name" in
    tests) step tests "${TESTS_LIMIT:-300}" python -m pytest -q -p no:cacheprovider "${workers[@]}" \
             tests/test_triton_attention.py tests/test_triton_rowwise.py tests/test_triton_kvcache.py \
             tests/test_tools.py ;;
    train) CUDA_LAUNCH_BLOCKING=1 step train "${TRAIN_LIMIT:-120}" python -m entmax_fast.train --quick \
             --device cuda --no-progress --out "$OUT_DIR/train" ;;
    hf) step hf "${HF_LIMIT:-180}" python bench/bench_hf_training.py --out "$OUT_DIR" \
          --jobs "$compile_jobs" ${HF_ARGS:-} ;;
    attention)
      quick=()
      [ "${QUICK:-0}" = "1" ] && quick=(--quick)
      step attention "${ATTENTION_LIMIT:-300}" python bench/bench_attention_gpu.py "${quick[@]}" \
        --out "$OUT_DIR" --jobs "$compile_jobs" ${ATTENTION_ARGS:---baseline-budget 120} ;;
    decode) step decode "${DECODE_LIMIT:-300}" python bench/bench_decode.py --device cuda --dtype float16 \
              --out "$OUT_DIR" ${DECODE_ARGS:---batches 1 4 16 --lengths 1024 8192 32768 131072} ;;
    profile) step profile "${PROFILE_LIMIT:-120}" python tools/profile_attention_gpu.py --causal ;;
    tune) step tune "${TUNE_LIMIT:-300}" python tools/tune_attention.py --causal ${TUNE_ARGS:-} ;;
    masked) step masked "${MASKED_LIMIT:-400}" python tools/tune_attention.py --causal --mask bool \
             ${MASKED_ARGS:---head-dims 64} --tiles 64x64 --fwd-launch 8x2 4x3 --bwd-launch 4x2 \
             --phases fused split --threshold-caps 128 ;;
    variants) step variants "${VARIANTS_LIMIT:-300}" python tools/attention_variants.py \
             --jobs 8 ${VARIANTS_ARGS:---variants kernel predicated_moments cap2 cap3 cap3_no_dmin} ;;
    bwd_variants) step bwd_variants "${VARIANTS_LIMIT:-300}" python tools/attention_variants.py \
             --jobs 8 --backward ${BWD_VARIANTS_ARGS:---variants kernel norm_per_score} ;;
    extension) MAX_JOBS="${MAX_JOBS:-16}" step extension "${EXTENSION_LIMIT:-600}" \
             python setup.py build_ext --inplace ;;
    rowwise) step rowwise "${ROWWISE_LIMIT:-120}" python bench/bench_rowwise_gpu.py --out "$OUT_DIR" \
               --jobs "$compile_jobs" ;;
    sweep) step sweep "${SWEEP_LIMIT:-300}" python bench/bench_rowwise_gpu.py --sweep --out "$OUT_DIR" \
             --sweep-lengths ${SWEEP_LENGTHS:-1024 4096} ;;
    structured)
      if has_cuda_extension; then
        step structured-tests "${STRUCTURED_LIMIT:-120}" python -m pytest -q -p no:cacheprovider \
          tests/test_structured.py -k "cuda_ops"
        step structured "${STRUCTURED_LIMIT:-120}" python bench/bench_structured.py --gpu-only
      else
        echo "=== structured: skipped (entmax_fast._C has no CUDA kernels here)"
      fi ;;
    context_parallel) step context_parallel "${CONTEXT_PARALLEL_LIMIT:-120}" python -m torch.distributed.run \
             --standalone --nproc_per_node "$(python -c 'import torch; print(max(1, torch.cuda.device_count()))')" \
             examples/context_parallel.py --backend nccl --steps 2 ;;
    *) echo "=== $name: unknown step"; failed=$((failed + 1)) ;;
  esac
done
# every log and table in one file, for a machine that hands back few files
for file in "$OUT_DIR"/device.txt "$OUT_DIR"/*.log "$OUT_DIR"/*.md; do
  [ -f "$file" ] && [ "$file" != "$OUT_DIR/summary.txt" ] && { echo "##### $(basename "$file")"; tail -c 20000 "$file"; }
done > "$OUT_DIR/summary.txt"
[ -n "${skipped:-}" ] && echo "gpu_check: skipped at the deadline: ${skipped}" | tee -a "$OUT_DIR/summary.txt"
echo "gpu_check: $failed step(s) failed; outputs in $OUT_DIR (all logs in summary.txt)"
exit "$failed"
