#!/usr/bin/env bash
# Installs what entmax_fast needs on a fresh machine and builds the package in place.
# Keeps an existing torch (e.g. a CUDA build); otherwise installs torch 2.13.0 (the CPU wheel
# on this project's machines). Safe to run repeatedly.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip --disable-pip-version-check -q"
if ! python -c "import torch" 2>/dev/null; then
  $PIP install torch==2.13.0
fi
# triton 3.9.0 is the version whose interpreter and compiler were checked here.
$PIP install "triton==3.9.0" "entmax==1.3" "transformers==5.24.0" pytest numpy scipy ninja matplotlib tqdm
# --no-build-isolation: build against the torch installed above instead of fetching another.
MAX_JOBS="${MAX_JOBS:-2}" $PIP install --no-build-isolation -e .
python - <<'PY'
import entmax_fast
for name, info in entmax_fast.backend_info()["backends"].items():
    print(f"entmax_fast backend {name}: {'available' if info['available'] else 'unavailable'} ({info['reason']})")
PY
