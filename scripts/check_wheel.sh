#!/usr/bin/env bash
# Checks the package as a user gets it: builds an sdist and, from it, a wheel (`python -m
# build`, with pip's build isolation: a pure-Python wheel carrying the C++ sources), installs
# the wheel into a fresh venv outside the checkout, builds the C++ extension there as a first
# use would (`python -m entmax_fast.backends.cpp.build`, into the user's cache, reused by the
# next run) and runs the test suite against the installed package.
#
#   bash scripts/check_wheel.sh                         # the whole suite
#   bash scripts/check_wheel.sh tests/test_install.py   # pytest arguments: some files only
#
# The venv gets the torch of the python that runs this script (TORCH_REQUIREMENT overrides,
# e.g. "torch==2.14.1"), the triton that torch pins, or for a CPU torch the triton installed
# here, and scripts/requirements-test.txt. CHECK_WHEEL_DIR keeps everything in a folder of your
# choice (default: a new temporary one, removed at the end unless KEEP=1).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="${CHECK_WHEEL_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/entmax_fast-wheel.XXXXXX")}"
case "$work" in "$root"|"$root"/*) echo "CHECK_WHEEL_DIR must be outside the checkout" >&2; exit 2;; esac
if [[ -z "${CHECK_WHEEL_DIR:-}" && "${KEEP:-0}" != 1 ]]; then
  trap 'rm -rf "$work"' EXIT
fi
mkdir -p "$work"
PIP=(--disable-pip-version-check -q)

torch_requirement="${TORCH_REQUIREMENT:-torch==$(python -c 'import importlib.metadata as m; print(m.version("torch"))')}"
triton_here="$(python -c 'import importlib.metadata as m; print(m.version("triton"))' 2>/dev/null || true)"
echo "check_wheel: in $work, with $torch_requirement"

# The checkout's files as git sees them (tracked and new, not ignored): no build outputs.
rm -rf "$work/src" "$work/dist"
mkdir -p "$work/src"
(cd "$root" && git ls-files --cached --others --exclude-standard -z \
  | tar --null -T - --ignore-failed-read -cf - 2>/dev/null) | tar -xf - -C "$work/src"

python -m venv "$work/build-env"
"$work/build-env/bin/python" -m pip install "${PIP[@]}" build
"$work/build-env/bin/python" -m build --outdir "$work/dist" "$work/src" > "$work/build.log" 2>&1 \
  || { tail -n 40 "$work/build.log"; exit 1; }
wheel=("$work"/dist/entmax_fast-*.whl)
sdist=("$work"/dist/entmax_fast-*.tar.gz)
echo "check_wheel: built ${sdist[0]##*/} and ${wheel[0]##*/}"

rm -rf "$work/venv"
python -m venv "$work/venv"
venv_python="$work/venv/bin/python"
"$venv_python" -m pip install "${PIP[@]}" "$torch_requirement"
if ! "$venv_python" -c 'import importlib.metadata as m, sys; sys.exit(not any(r.startswith("triton") for r in m.requires("torch") or ()))' \
   && [[ -n "$triton_here" ]]; then
  "$venv_python" -m pip install "${PIP[@]}" "triton==$triton_here"
fi
# The installed torch and triton, pinned for the rest.
"$venv_python" -c 'import importlib.metadata as m
for name in ("torch", "triton"):
    try: print(f"{name}=={m.version(name)}")
    except m.PackageNotFoundError: pass' > "$work/constraints.txt"
"$venv_python" -m pip install "${PIP[@]}" -c "$work/constraints.txt" "${wheel[0]}" -r "$root/scripts/requirements-test.txt"
"$venv_python" -m pip check

# From $work, not the source tree: the import must find the installed package.
(cd "$work" && "$venv_python" -m entmax_fast.backends.cpp.build)
(cd "$work" && "$venv_python" "$root/scripts/installed.py" check_wheel)

# Run from $work, beside the copy: pytest's own script does not put the working directory on
# sys.path (python -m pytest would), and the tests' `python -c` subprocesses, which do, find
# no entmax_fast/ there. tests/conftest.py checks where the package came from when
# ENTMAX_FAST_TEST_INSTALLED=1.
cd "$work"
args=()
for arg in "$@"; do
  if [[ "$arg" == tests* ]]; then args+=("src/$arg"); else args+=("$arg"); fi
done
((${#args[@]})) || args=(src/tests)
ENTMAX_FAST_TEST_INSTALLED=1 "$work/venv/bin/pytest" -q -p no:cacheprovider "${args[@]}"
