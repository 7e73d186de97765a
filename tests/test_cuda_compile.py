"""Every CUDA source compiles for Ampere (sm_80) and Hopper (sm_90): `nvcc -c`, no GPU needed.

Also compiles (syntax only) the C++ sources' CUDA-only host code, the parts guarded by
ENTMAX_FAST_WITH_CUDA, which a CPU build never sees.

Without nvcc the tests skip, except under CI (the CI environment variable set), where a
missing nvcc is a failure: CI must not pass without compiling the kernels.
"""
import os
import pathlib
import shutil
import subprocess
import sysconfig

import pytest
import torch.utils.cpp_extension as cpp_extension

from entmax_fast.backends.cpp import build

ROOT = pathlib.Path(__file__).resolve().parents[1]
CUDA_SOURCES = sorted(ROOT.glob("csrc/**/*.cu"))
CUDA_HOST_SOURCES = sorted(path for path in ROOT.glob("csrc/**/*.cpp") if "ENTMAX_FAST_WITH_CUDA" in path.read_text())
ARCHS = ("80", "90")


def _standard(flags):
    """The -std= flag of a build's flags: the tests compile as the build does (torch's own
    headers need C++20 from torch 2.14 on)."""
    return next(flag for flag in flags if flag.startswith("-std="))


def find_nvcc():
    candidates = [shutil.which("nvcc")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(os.path.join(home, "bin", "nvcc"))
    for candidate in candidates:
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


@pytest.fixture(scope="module")
def nvcc():
    path = find_nvcc()
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("nvcc not found (PATH, CUDA_HOME, /usr/local/cuda) and CI is set: the CUDA sources "
                        "must be compile-checked in CI")
        pytest.skip("nvcc not found; set CUDA_HOME or put nvcc on PATH")
    return path


@pytest.fixture(scope="module")
def include_flags(tmp_path_factory):
    """Torch include dirs; plus a stand-in for the one generated header that torch's CPU
    wheels leave out (c10/cuda/impl/cuda_cmake_macros.h), so c10/cuda headers parse."""
    flags = [f"-I{path}" for path in cpp_extension.include_paths()]
    if not any(pathlib.Path(path, "c10/cuda/impl/cuda_cmake_macros.h").exists() for path in cpp_extension.include_paths()):
        stub = tmp_path_factory.mktemp("cuda_stub")
        header = stub / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
        header.parent.mkdir(parents=True)
        header.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        flags.append(f"-I{stub}")
    return flags


def test_there_are_cuda_sources():
    assert CUDA_SOURCES, "no csrc/**/*.cu found"


@pytest.mark.parametrize("source", CUDA_SOURCES, ids=[str(p.relative_to(ROOT)) for p in CUDA_SOURCES])
def test_nvcc_compiles_for_sm80_and_sm90(source, nvcc, include_flags, tmp_path):
    gencode = [flag for arch in ARCHS for flag in ("-gencode", f"arch=compute_{arch},code=sm_{arch}")]
    command = [nvcc, "-c", _standard(build.NVCC_FLAGS), "-O3", "-DENTMAX_FAST_WITH_CUDA", *gencode, *include_flags,
               str(source), "-o", str(tmp_path / "out.o")]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, f"nvcc failed for {source.name} (sm_{'/sm_'.join(ARCHS)}):\n{result.stderr[-6000:]}"


@pytest.mark.parametrize("source", CUDA_HOST_SOURCES, ids=[str(p.relative_to(ROOT)) for p in CUDA_HOST_SOURCES])
def test_cuda_host_code_compiles(source, nvcc, include_flags):
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no host C++ compiler")
    homes = [os.environ.get("CUDA_HOME"), cpp_extension.CUDA_HOME, "/usr/local/cuda",
             str(pathlib.Path(nvcc).resolve().parents[1])]
    includes = [pathlib.Path(home, "include") for home in homes if home]
    cuda_include = next((path for path in includes if (path / "cuda_runtime.h").exists()), None)
    if cuda_include is None:
        pytest.fail(f"nvcc found at {nvcc} but no cuda_runtime.h under {[str(p) for p in includes]}")
    command = [compiler, "-fsyntax-only", _standard(build.CXX_FLAGS), "-DENTMAX_FAST_WITH_CUDA", *include_flags,
               f"-I{cuda_include}", f"-I{sysconfig.get_paths()['include']}", str(source)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, f"{source.name} with ENTMAX_FAST_WITH_CUDA:\n{result.stderr[-6000:]}"
