#!/usr/bin/env bash
# Builds the documentation site (mkdocs.yml) into build/docs/, warnings as errors, and checks
# it with tests/test_docs.py: every public name has a reference entry with its signature,
# the docstrings' examples and the guides' code run. Installs the pinned doc tools when they
# are missing (none of them depends on torch or triton, which are left as they are).
set -euo pipefail
cd "$(dirname "$0")/.."
REQUIREMENTS=("mkdocs==1.6.1" "mkdocs-material==9.8.1" "mkdocstrings==1.0.8" "mkdocstrings-python==2.0.11"
              "griffe==2.4.1" "mkdocs-autorefs==1.4.5" "pymdown-extensions==13.1" "Markdown==3.11.3"
              "black==26.10.1")
mapfile -t missing < <(python - "${REQUIREMENTS[@]}" <<'PY'
import importlib.metadata as metadata
import sys

for requirement in sys.argv[1:]:
    name, _, pinned = requirement.partition("==")
    try:
        if metadata.version(name) == pinned:
            continue
    except metadata.PackageNotFoundError:
        pass
    print(requirement)
PY
)
if ((${#missing[@]})); then
  python -m pip --disable-pip-version-check -q install "${missing[@]}"
fi
# The theme's notice about its successor is not a warning about this site.
export NO_MKDOCS_2_WARNING=1
python -m mkdocs build --strict --clean --site-dir build/docs
ENTMAX_FAST_DOCS_SITE=build/docs python -m pytest -q -p no:cacheprovider tests/test_docs.py
