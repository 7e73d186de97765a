"""entmax_fast as a drop-in for ``entmax`` 1.3, checked by entmax's own tests.

The package ships its tests; test_losses.py, test_mask.py and test_root_finding.py are copied
into a temporary folder with every ``from entmax... import`` re-pointed at ``entmax_fast``
(which has the same public names at top level), then run by pytest in a subprocess. Its
test_topk.py is not run: it tests entmax's private partial-sort helpers, which entmax_fast
does not have (its sparsemax and entmax15 accept ``k`` and ignore it).

entmax's tests draw their data from torch's generator without a seed; the folder's
conftest.py seeds it at import (test_losses.py draws at import) and before each test, as
tests/conftest.py does here, so that a run is reproducible.
"""
import os
import pathlib
import re
import subprocess
import sys
import xml.etree.ElementTree as ElementTree

import entmax
import pytest
import torch

import entmax_fast

ENTMAX_TESTS = pathlib.Path(entmax.__file__).parent
FILES = ("test_losses.py", "test_mask.py", "test_root_finding.py")
TIMEOUT_S = 300

# entmax's tests that check what entmax_fast deliberately does differently: not run, and why.
DIFFERENT = {
    "test_root_finding.py::test_budget_grad_multiple_k": (
        "it calls normmax_bisect (not budget_bisect) with α drawn from [0, 6), so about half the draws hold an "
        "α <= 1, outside normmax's domain (there the α-norm's maximiser is argmax, with no gradient); entmax "
        "returns NaN rows for them and fails this test itself, entmax_fast refuses α <= 1 with a ValueError. "
        "Per-row budgets, which its name promises, and per-row α > 1 are checked in "
        "tests/test_normmax_budget_per_row.py."),
}

CONFTEST = '''import pytest
import torch

torch.manual_seed(0)


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)
    yield
'''

_FROM_IMPORT = re.compile(r"^(\s*)from\s+entmax(?:\.\w+)*\s+import\b", re.MULTILINE)
_PLAIN_IMPORT = re.compile(r"^(\s*)import\s+entmax\s*$", re.MULTILINE)
_ANY_ENTMAX_IMPORT = re.compile(r"^\s*(?:from|import)\s+entmax\b(?!_fast).*$", re.MULTILINE)


def _repointed(name: str, source: str) -> str:
    rewritten = _FROM_IMPORT.sub(r"\1from entmax_fast import", source)
    rewritten = _PLAIN_IMPORT.sub(r"\1import entmax_fast as entmax", rewritten)
    assert rewritten != source, f"{name}: no entmax import found to re-point"
    leftover = _ANY_ENTMAX_IMPORT.findall(rewritten)
    assert not leftover, f"{name}: imports of entmax left after re-pointing: {leftover}"
    return rewritten


def test_entmax_own_tests_pass_against_entmax_fast(tmp_path):
    for name in FILES:
        (tmp_path / name).write_text(_repointed(name, (ENTMAX_TESTS / name).read_text()))
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    report = tmp_path / "report.xml"
    # Without this run's pytest settings (PYTEST_ADDOPTS, the xdist worker's variables).
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
    # The entmax_fast this process imported, whatever the subprocess's path would find first.
    package_root = str(pathlib.Path(entmax_fast.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    # As many threads as this process (one pytest-xdist worker's share of the cores).
    env["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
               "--rootdir", str(tmp_path), "-c", str(tmp_path / "pytest.ini"), f"--junitxml={report}"]
    for test_id in DIFFERENT:
        command += ["--deselect", test_id]
    try:
        run = subprocess.run(command + list(FILES), cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        # TimeoutExpired holds bytes whatever text= says.
        partial = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        pytest.fail(f"entmax's tests did not finish within {TIMEOUT_S} s:\n{partial[-4000:]}")
    output = run.stdout[-4000:] + run.stderr[-2000:]
    assert report.exists(), f"pytest wrote no report (exit code {run.returncode}):\n{output}"

    passed, failed = set(), {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        # The files lie at the folder's top and hold no test classes: classname is the module.
        test_id = f"{case.get('classname')}.py::{case.get('name')}"
        problems = [child for child in case if child.tag in ("failure", "error", "skipped")]
        if problems:
            first_line = ((problems[0].get("message") or "").splitlines() or [""])[0]
            failed[test_id] = f"{problems[0].tag}: {first_line}"
        else:
            passed.add(test_id)
    assert not failed, ("entmax's tests failing against entmax_fast:\n"
                        + "\n".join(f"  {test_id}  {why}" for test_id, why in sorted(failed.items()))
                        + f"\n{output}")
    assert run.returncode == 0, f"pytest exited with {run.returncode}:\n{output}"
    # Every file ran, and every test set aside above was found (so that the list stays true).
    assert {test_id.partition("::")[0] for test_id in passed} == set(FILES), sorted(passed)
    assert f"{len(DIFFERENT)} deselected" in run.stdout, output
