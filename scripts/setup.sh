#!/usr/bin/env bash
# Installs what entmax_fast needs on a fresh machine and builds the package in place.
# Never changes an installed torch, nor the triton that torch pins: torch 2.13.0 (the CPU
# wheel on this project's machines) is installed only where no torch is; a torch that pins
# triton (the CUDA builds) keeps its own; a CPU torch gets triton 3.9.0 for the interpreter
# tests where no triton is installed. Every pip call is constrained to the torch and triton
# found, so that pip fails instead of swapping them; `pip check` closes the run.
# Safe to run repeatedly, and quick the second time: packages already at the pinned versions
# are not handed to pip, and the C++ extension is rebuilt only when csrc/, its flags (setup.py,
# entmax_fast/backends/cpp/build.py), torch, Python or CUDA_HOME changed since it was built (a
# fingerprint of those is kept in build/, whose object files make a rebuild incremental).
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip --disable-pip-version-check -q"
TORCH_WHEN_MISSING="torch==2.13.0"
# The triton whose interpreter and compiler were checked with a CPU torch (which pins none).
TRITON_FOR_CPU_TORCH="triton==3.9.0"
mapfile -t REQUIREMENTS < <(grep -v -e "^#" -e "^$" scripts/requirements-test.txt)
CONSTRAINTS=build/setup-constraints.txt
FINGERPRINT_FILE=build/entmax_fast_C.fingerprint
METADATA_FINGERPRINT_FILE=build/editable-install.fingerprint

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
for path in sorted(pathlib.Path("csrc").rglob("*")) + [pathlib.Path("setup.py"), pathlib.Path("entmax_fast/backends/cpp/build.py")]:
    if path.is_file():
        digest.update(str(path).encode() + b"\0" + path.read_bytes() + b"\0")
for part in (metadata.version("torch"), sys.version, os.environ.get("CUDA_HOME", ""), shutil.which("nvcc") or ""):
    digest.update(part.encode() + b"\0")
print(digest.hexdigest())
PY
}

# The editable install of this checkout, without building the extension (built below, in
# place, so that build/ keeps its object files between runs), made from the setup.py and
# pyproject.toml there now (their requirements are in its metadata, which pip check reads).
installed_here() {
  python - "$METADATA_FINGERPRINT_FILE" <<'PY'
import hashlib
import importlib.metadata as metadata
import json
import pathlib
import sys

try:
    url = json.loads(metadata.distribution("entmax_fast").read_text("direct_url.json") or "{}").get("url", "")
except metadata.PackageNotFoundError:
    sys.exit(1)
recorded = pathlib.Path(sys.argv[1])
current = hashlib.sha256(pathlib.Path("setup.py").read_bytes() + pathlib.Path("pyproject.toml").read_bytes()).hexdigest()
sys.exit(0 if url == pathlib.Path.cwd().resolve().as_uri() and recorded.is_file()
         and recorded.read_text().strip() == current else 1)
PY
}

# Prints the triton requirement to install: none when torch pins one (installed with it) or
# when a triton is installed already; TRITON_FOR_CPU_TORCH otherwise.
triton_to_install() {
  python - "$TRITON_FOR_CPU_TORCH" <<'PY'
import importlib.metadata as metadata
import sys

pins = [r for r in metadata.requires("torch") or () if r.replace(" ", "").lower().startswith("triton")]
try:
    metadata.version("triton")
except metadata.PackageNotFoundError:
    if not pins:
        print(sys.argv[1])
PY
}

# Writes a pip constraints file pinning the installed torch and triton, and torch's bound on
# setuptools (pip adds it to the constraints of its configuration).
write_constraints() {
  mkdir -p build
  python - "$CONSTRAINTS" <<'PY'
import importlib.metadata as metadata
import sys

lines = []
for name in ("torch", "triton"):
    try:
        lines.append(f"{name}=={metadata.version(name)}")
    except metadata.PackageNotFoundError:
        pass
# torch's own bound on setuptools (torch 2.12: <82), which a build requirement must keep.
if lines and lines[0].startswith("torch"):
    lines += [r for r in metadata.requires("torch") or () if r.replace(" ", "").lower().startswith("setuptools")]
with open(sys.argv[1], "w") as handle:
    handle.write("\n".join(lines) + "\n")
PY
  CONSTRAINT_ARGS=(-c "$CONSTRAINTS")
}

if missing_requirements torch | grep -q .; then
  echo "entmax_fast: no torch installed; installing $TORCH_WHEN_MISSING"
  $PIP install "$TORCH_WHEN_MISSING"
fi
write_constraints
triton="$(triton_to_install)"
if [[ -n "$triton" ]]; then
  $PIP install "${CONSTRAINT_ARGS[@]}" "$triton"
  write_constraints
fi
mapfile -t missing < <(missing_requirements "${REQUIREMENTS[@]}")
if ((${#missing[@]})); then
  $PIP install "${CONSTRAINT_ARGS[@]}" "${missing[@]}"
fi
if ! installed_here; then
  # What pyproject.toml's build-system asks for, which --no-build-isolation does not install:
  # setuptools >= 64, and the wheel package where setuptools is older than 70.1 (which has
  # bdist_wheel itself; a Python 3.11 venv comes with setuptools 65).
  mapfile -t build_requirements < <(python - <<'PY'
import importlib.metadata as metadata

try:
    setuptools = tuple(int(part) for part in metadata.version("setuptools").split(".")[:2])
except (metadata.PackageNotFoundError, ValueError):
    setuptools = (0, 0)
if setuptools < (64, 0):
    print("setuptools>=64")
if setuptools < (70, 1):
    try:
        metadata.version("wheel")
    except metadata.PackageNotFoundError:
        print("wheel")
PY
  )
  if ((${#build_requirements[@]})); then
    $PIP install "${CONSTRAINT_ARGS[@]}" "${build_requirements[@]}"
  fi
  # --no-build-isolation: build against the torch installed above instead of fetching another;
  # --no-deps: the requirements are in place, and torch's is never handed to pip again.
  ENTMAX_FAST_NO_EXT=1 $PIP install "${CONSTRAINT_ARGS[@]}" --no-build-isolation --no-deps -e .
  python -c 'import hashlib, pathlib; print(hashlib.sha256(pathlib.Path("setup.py").read_bytes()
      + pathlib.Path("pyproject.toml").read_bytes()).hexdigest())' > "$METADATA_FINGERPRINT_FILE"
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

if ! python -m pip check; then
  echo "entmax_fast: pip check found broken requirements (above); setup failed" >&2
  exit 1
fi

python scripts/installed.py entmax_fast --backends
