#!/usr/bin/env bash
# Installs what entmax_fast needs on a fresh machine and builds the package in place.
# Keeps an existing torch (e.g. a CUDA build); otherwise installs torch 2.13.0 (the CPU wheel
# on this project's machines). Safe to run repeatedly, and quick the second time: packages
# already at the pinned versions are not handed to pip, and the C++ extension is rebuilt only
# when csrc/, setup.py, torch, Python or CUDA_HOME changed since it was built (a fingerprint of
# those is kept in build/, whose object files make a rebuild incremental).
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip --disable-pip-version-check -q"
# triton 3.9.0 is the version whose interpreter and compiler were checked here.
REQUIREMENTS=("triton==3.9.0" "entmax==1.3" "transformers==5.24.0" pytest "pytest-xdist==3.8.0" numpy scipy ninja matplotlib tqdm)
FINGERPRINT_FILE=build/entmax_fast_C.fingerprint

# Prints the requirements (arguments) that are not installed at the pinned version; reads
# package metadata only, without importing anything heavy.
missing_requirements() {
  python - "$@" <<'PY'
import importlib.metadata as metadata
import sys

for requirement in sys.argv[1:]:
    name, _, pinned = requirement.partition("==")
    try:
        installed = metadata.version(name)
    except metadata.PackageNotFoundError:
        print(requirement)
        continue
    if pinned and installed != pinned:
        print(requirement)
PY
}

# Prints a fingerprint of everything the built extension depends on.
extension_fingerprint() {
  python - <<'PY'
import hashlib
import importlib.metadata as metadata
import os
import pathlib
import shutil
import sys

digest = hashlib.sha256()
for path in sorted(pathlib.Path("csrc").rglob("*")) + [pathlib.Path("setup.py")]:
    if path.is_file():
        digest.update(str(path).encode() + b"\0" + path.read_bytes() + b"\0")
for part in (metadata.version("torch"), sys.version, os.environ.get("CUDA_HOME", ""), shutil.which("nvcc") or ""):
    digest.update(part.encode() + b"\0")
print(digest.hexdigest())
PY
}

# The editable install of this checkout, without building the extension (built below, in
# place, so that build/ keeps its object files between runs).
installed_here() {
  python - <<'PY'
import importlib.metadata as metadata
import json
import pathlib
import sys

try:
    url = json.loads(metadata.distribution("entmax_fast").read_text("direct_url.json") or "{}").get("url", "")
except metadata.PackageNotFoundError:
    sys.exit(1)
sys.exit(0 if url == pathlib.Path.cwd().resolve().as_uri() else 1)
PY
}

if missing_requirements torch | grep -q .; then
  $PIP install torch==2.13.0
fi
mapfile -t missing < <(missing_requirements "${REQUIREMENTS[@]}")
if ((${#missing[@]})); then
  $PIP install "${missing[@]}"
fi
if ! installed_here; then
  # --no-build-isolation: build against the torch installed above instead of fetching another.
  ENTMAX_FAST_NO_EXT=1 $PIP install --no-build-isolation -e .
fi

if [[ "${ENTMAX_FAST_NO_EXT:-0}" == 1 ]]; then
  echo "entmax_fast: ENTMAX_FAST_NO_EXT=1, C++ extension not built"
else
  fingerprint="$(extension_fingerprint)"
  built=(entmax_fast/_C*.so)
  if [[ -f "${built[0]}" && -f "$FINGERPRINT_FILE" && "$(cat "$FINGERPRINT_FILE")" == "$fingerprint" ]]; then
    echo "entmax_fast: C++ extension up to date with csrc/ (${built[0]})"
  else
    echo "entmax_fast: building the C++ extension (minutes the first time; log in build/extension-build.log)"
    mkdir -p build
    rm -f "$FINGERPRINT_FILE"
    touch build/.extension-build-started
    # --force: setuptools alone compares only the .cpp files' times with the .so; ninja then
    # recompiles just the objects whose sources or headers changed.
    MAX_JOBS="${MAX_JOBS:-2}" python setup.py build_ext --inplace --force > build/extension-build.log 2>&1 || true
    built=(entmax_fast/_C*.so)
    # setup.py reports a failed build and goes on (the package works without the extension);
    # only a build that produced the extension is remembered as done.
    if [[ -f "${built[0]}" && "${built[0]}" -nt build/.extension-build-started ]]; then
      echo "$fingerprint" > "$FINGERPRINT_FILE"
      echo "entmax_fast: built ${built[0]}"
    else
      echo "entmax_fast: the C++ extension failed to build (the backend lines below say what runs); end of the log:"
      tail -n 25 build/extension-build.log
    fi
  fi
fi

python - <<'PY'
import entmax_fast

for name, info in entmax_fast.backend_info()["backends"].items():
    print(f"entmax_fast backend {name}: CPU tensors: {info['cpu']}; CUDA tensors: {info['cuda']}")
PY
