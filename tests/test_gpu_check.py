"""bench/gpu_check.sh read from its dry run (DRY_RUN=1 prints each step's limit and command
instead of running it, so it needs no GPU): bounded by a deadline (a caller with a fixed
time limit cuts the run off from outside, and whatever the run has not written by then is
lost, so the script itself must fit its steps into the time it is given), and running the
benchmarks of bench/ and the tools of tools/ where they are."""
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "bench" / "gpu_check.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def dry_run(tmp_path, **env):
    """The limits the dry run prints, {step: seconds}, the steps it skips and its exit
    status."""
    environment = {**os.environ, "DRY_RUN": "1", "OUT_DIR": str(tmp_path),
                   "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    environment.pop("DEADLINE", None)
    environment.pop("BUDGET", None)
    environment.update(env)
    result = subprocess.run(["bash", str(SCRIPT)], env=environment, capture_output=True,
                            text=True, timeout=120)
    limits = {name: int(seconds) for name, seconds
              in re.findall(r"^=== (\S+) \(limit (\d+) s\)", result.stdout, re.MULTILINE)}
    skipped = re.findall(r"^=== (\S+): skipped \(", result.stdout, re.MULTILINE)
    return limits, skipped, result.returncode


def test_without_a_deadline_each_step_keeps_its_own_limit(tmp_path):
    limits, skipped, status = dry_run(tmp_path, STEPS="tests tune rowwise", TESTS_LIMIT="150",
                                      TUNE_LIMIT="120")
    assert limits == {"tests": 150, "tune": 120, "rowwise": 120}
    assert skipped == [] and status == 0


def test_a_budget_cuts_the_limits_to_the_time_left(tmp_path):
    # 30 s stay free for a cut step's grace period and the summary
    limits, skipped, status = dry_run(tmp_path, STEPS="tests tune", TESTS_LIMIT="150",
                                      TUNE_LIMIT="40", BUDGET="130")
    assert skipped == [] and status == 0
    assert 95 <= limits["tests"] <= 100
    assert limits["tune"] == 40


def test_a_step_that_no_longer_fits_is_skipped_and_named(tmp_path):
    limits, skipped, status = dry_run(tmp_path, STEPS="tests rowwise", BUDGET="55")
    assert limits == {} and skipped == ["tests", "rowwise"]
    assert "skipped at the deadline: tests rowwise" in (tmp_path / "summary.txt").read_text()
    assert status == 0


def test_a_deadline_in_the_past_runs_nothing(tmp_path):
    limits, skipped, _ = dry_run(tmp_path, STEPS="attention", DEADLINE="1")
    assert limits == {} and skipped == ["attention"]


def test_an_unknown_step_fails_the_run(tmp_path):
    _, _, status = dry_run(tmp_path, STEPS="tests no_such_step")
    assert status == 1


def test_the_timing_steps_compile_their_kernels_first_in_parallel(tmp_path):
    """The attention, rowwise and hf steps meet their kernels cold on a fresh machine:
    each passes COMPILE_JOBS to its script's --jobs, so that its limit goes to timing."""
    environment = {**os.environ, "DRY_RUN": "1", "OUT_DIR": str(tmp_path), "QUICK": "1",
                   "STEPS": "attention rowwise hf", "COMPILE_JOBS": "5"}
    environment.pop("DEADLINE", None)
    environment.pop("BUDGET", None)
    result = subprocess.run(["bash", str(SCRIPT)], env=environment, capture_output=True,
                            text=True, timeout=120)
    commands = dict(re.findall(r"^=== (\S+) \(limit \d+ s\): (.*)$", result.stdout, re.MULTILINE))
    assert set(commands) == {"attention", "rowwise", "hf"}
    for name, command in commands.items():
        assert "--jobs 5" in command, (name, command)


ALL_STEPS = ("tests train hf attention decode rowwise sweep extension profile tune masked variants "
             "bwd_variants structured context_parallel")


def test_every_step_runs_a_file_that_is_there(tmp_path):
    """Each step's command names scripts and test files that exist: the user benchmarks
    under bench/, the kernel-development tools (profile, tune, masked, variants,
    bwd_variants) under tools/, and the tests step runs the tools' tests too."""
    environment = {**os.environ, "DRY_RUN": "1", "OUT_DIR": str(tmp_path), "STEPS": ALL_STEPS}
    environment.pop("DEADLINE", None)
    environment.pop("BUDGET", None)
    result = subprocess.run(["bash", str(SCRIPT)], env=environment, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    commands = dict(re.findall(r"^=== (\S+) \(limit \d+ s\): (.*)$", result.stdout, re.MULTILINE))
    assert set(ALL_STEPS.split()) - {"structured"} <= set(commands)
    root = SCRIPT.parent.parent
    for name, command in commands.items():
        for path in re.findall(r"(?:^|\s)((?:bench|tools|tests|examples)/\S+\.py)\b", command):
            assert (root / path).is_file(), (name, path)
    folders = {name: re.search(r"python ((?:bench|tools)/)\S+\.py", command)
               for name, command in commands.items()}
    for name in ("profile", "tune", "masked", "variants", "bwd_variants"):
        assert folders[name].group(1) == "tools/", (name, commands[name])
    for name in ("hf", "attention", "rowwise", "sweep"):
        assert folders[name].group(1) == "bench/", (name, commands[name])
    assert "tests/test_tools.py" in commands["tests"]
    assert "examples/context_parallel.py --backend nccl" in commands["context_parallel"]
