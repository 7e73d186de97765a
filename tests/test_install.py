"""Installing: the first-use build of the C++ extension (cache key, lock between processes,
remembered failures, CUDA only with nvcc), the loader's report and warning when there is no
extension, the sources shipped with the package, and the interpreter shortcuts switched on
only for the triton releases they were checked on.

The builds here compile nothing: the compiler is replaced by a function that writes a file
(and counts its calls), so that the locking and caching are checked in seconds; the real
build is checked end to end by scripts/check_wheel.sh.
"""
import os
import pathlib
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import triton_interpreter
from entmax_fast.backends.cpp import build, loader

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture
def tiny_sources(tmp_path, monkeypatch):
    """A source tree of two files, and an empty cache, in place of the package's."""
    sources = tmp_path / "csrc"
    (sources / "cpu").mkdir(parents=True)
    (sources / "module.cpp").write_text("// module\n")
    (sources / "cpu" / "op.cpp").write_text("// op\n")
    monkeypatch.setattr(build, "sources_dir", lambda: sources)
    monkeypatch.setenv(build.ENV_CACHE_DIR, str(tmp_path / "cache"))
    monkeypatch.delenv(build.ENV_BUILD_ON_USE, raising=False)
    return sources


def _fake_compile(calls):
    def compile(cfg, directory):
        calls.append((cfg.with_cuda, directory))
        library = directory / f"{build.LIBRARY_NAME}.so"
        library.write_text("built")
        return library
    return compile


def test_key_follows_every_source_byte_and_the_build(tiny_sources):
    first = build.config()
    assert first.key == build.config().key
    assert [path.name for path in first.sources] == ["op.cpp", "module.cpp"]
    (tiny_sources / "cpu" / "op.cpp").write_text("// op, changed\n")
    changed = build.config()
    assert changed.key != first.key
    (tiny_sources / "cpu" / "kinds.h").write_text("// a header\n")
    assert build.config().key != changed.key, "a header is compiled into the library too"
    assert build.config(with_cuda=True).key != build.config(with_cuda=False).key


def test_flags_are_fresh_lists():
    """torch.utils.cpp_extension appends to the flag lists it is given; a shared list would
    carry one build's flags into the next (and into its key)."""
    first = build.build_flags(with_cuda=True)
    for flags in first.values():
        flags.append("-lcudart")
    assert all("-lcudart" not in flags for flags in build.build_flags(with_cuda=True).values())


def test_cuda_archs_where_torch_would_find_none(monkeypatch):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_80", "sm_90", "sm_90a", "sm_120"])
    assert build.cuda_arch_flags() == ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
                                       "-gencode=arch=compute_120,code=sm_120",
                                       "-gencode=arch=compute_120,code=compute_120"]
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0")
    assert build.cuda_arch_flags() == []


def test_sources_with_one_object_name_are_refused(tiny_sources):
    (tiny_sources / "cuda").mkdir()
    (tiny_sources / "cuda" / "op.cpp").write_text("// another op\n")
    with pytest.raises(build.BuildError, match="clash"):
        build.config()


def test_built_once_then_found_in_the_cache(tiny_sources, capfd):
    calls, loaded = [], []
    cfg = build.config()
    library = build.ensure_built(cfg, compile=_fake_compile(calls), load=loaded.append)
    assert library.read_text() == "built" and len(calls) == 1
    assert "building the C++ extension" in capfd.readouterr().err
    assert build.ensure_built(cfg, compile=_fake_compile(calls), load=loaded.append) == library
    assert len(calls) == 1 and loaded == [library], "the second call loads the cached library"
    assert capfd.readouterr().err == ""
    assert library.parent.name.startswith(f"torch{torch.__version__.replace('+', '-')}-")


def test_a_deleted_library_is_built_again(tiny_sources):
    calls = []
    library = build.ensure_built(build.config(), compile=_fake_compile(calls), load=lambda path: None)
    library.unlink()
    build.ensure_built(build.config(), compile=_fake_compile(calls), load=lambda path: None)
    assert len(calls) == 2 and library.exists()


def test_a_failed_build_is_remembered_until_retried(tiny_sources):
    calls = []

    def failing(cfg, directory):
        calls.append(directory)
        raise RuntimeError("Error building extension 'entmax_fast_C'\nop.cpp:1: error: expected ';'")

    cfg = build.config()
    with pytest.raises(build.BuildError, match="compiler output") as first:
        build.ensure_built(cfg, compile=failing)
    failed = build.build_dir(cfg) / "FAILED"
    assert "expected ';'" in failed.read_text() and str(failed) in str(first.value)
    with pytest.raises(build.BuildError, match=build.BUILD_COMMAND) as second:
        build.ensure_built(cfg, compile=failing)
    assert len(calls) == 1 and "Error building extension" in str(second.value)
    library = build.ensure_built(cfg, retry_failed=True, compile=_fake_compile([]), load=lambda path: None)
    assert library.exists() and not failed.exists()


def test_no_compiler_and_build_switched_off_say_so(tiny_sources, monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    with pytest.raises(build.BuildError, match="no C.. compiler found"):
        build.ensure_built(build.config(), compile=_fake_compile([]))
    monkeypatch.setenv(build.ENV_BUILD_ON_USE, "0")
    with pytest.raises(build.BuildError, match=f"{build.ENV_BUILD_ON_USE}=0"):
        build.ensure_built(build.config(), compile=_fake_compile([]))
    monkeypatch.delenv("CXX")
    monkeypatch.delenv(build.ENV_BUILD_ON_USE)
    library = build.ensure_built(build.config(), compile=_fake_compile([]), load=lambda path: None)
    monkeypatch.setenv(build.ENV_BUILD_ON_USE, "0")
    assert build.ensure_built(build.config(), compile=_fake_compile([]), load=lambda path: None) == library, \
        "a library built before is still loaded"


def test_cuda_operators_need_nvcc_itself(tmp_path, monkeypatch):
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setattr(torch.version, "cuda", None)
    assert build.cuda_toolkit() == (None, "torch is a CPU build")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    assert "no CUDA toolkit was found" in build.cuda_toolkit()[1]
    # torch guesses /usr/local/cuda where nothing is installed
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(tmp_path))
    nvcc, why = build.cuda_toolkit()
    assert nvcc is None and f"{tmp_path / 'bin' / 'nvcc'} does not exist" in why
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("#!/bin/sh\n")
    (tmp_path / "bin" / "nvcc").chmod(0o755)
    assert build.cuda_toolkit() == (str(tmp_path / "bin" / "nvcc"), "")


def test_a_failed_cuda_build_falls_back_to_the_cpu_operators(tiny_sources, monkeypatch):
    (tiny_sources / "cpu" / "kernel.cu").write_text("// kernel\n")
    monkeypatch.setattr(build, "cuda_toolkit", lambda: ("/opt/cuda/bin/nvcc", ""))
    calls = []

    def compile(cfg, directory):
        if cfg.with_cuda:
            calls.append("cuda")
            raise RuntimeError("nvcc fatal: unsupported gpu architecture")
        calls.append("cpu")
        return _fake_compile([])(cfg, directory)

    assert [path.name for path in build.config().sources] == ["kernel.cu", "op.cpp", "module.cpp"]
    library, cuda_absent = build.obtain(compile=compile, load=lambda path: None)
    assert calls == ["cuda", "cpu"] and library.exists()
    assert cuda_absent.startswith("the build with nvcc failed") and "FAILED" in cuda_absent
    assert [path.name for path in build.config(with_cuda=False).sources] == ["op.cpp", "module.cpp"]
    build.obtain(compile=compile, load=lambda path: None)
    assert calls == ["cuda", "cpu"], "both outcomes are remembered"


_BUILDER = textwrap.dedent("""
    import os, pathlib, sys, time
    from entmax_fast.backends.cpp import build

    sources = pathlib.Path(sys.argv[1])
    build.sources_dir = lambda: sources
    def compile(cfg, directory):
        with open(sources.parent / "compiles", "a") as log:
            log.write(f"{os.getpid()}\\n")
        # holds the lock until every process has asked for the library
        deadline = time.monotonic() + 90
        while len((sources.parent / "started").read_text().split()) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        library = directory / "lib.so"
        library.write_text(str(os.getpid()))
        return library
    cfg = build.config()
    with open(sources.parent / "started", "a") as log:
        log.write(f"{os.getpid()}\\n")
    print(build.ensure_built(cfg, compile=compile, load=lambda path: None))
""")


def test_concurrent_first_calls_build_once(tiny_sources):
    env = dict(os.environ, **{build.ENV_CACHE_DIR: os.environ[build.ENV_CACHE_DIR]})
    processes = [subprocess.Popen([sys.executable, "-c", _BUILDER, str(tiny_sources)], env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(4)]
    results = [process.communicate(timeout=120) for process in processes]
    assert all(process.returncode == 0 for process in processes), [err[-2000:] for _, err in results]
    assert len((tiny_sources.parent / "compiles").read_text().split()) == 1
    assert len({out.strip() for out, _ in results}) == 1, "every process gets the one library"
    errors = "".join(err for _, err in results)
    assert errors.count("entmax_fast: building the C++ extension") == 1
    assert "waiting for another process" in errors


def test_a_killed_builder_does_not_block_the_next(tiny_sources, tmp_path):
    cfg = build.config()
    directory = build.build_dir(cfg)
    directory.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from entmax_fast.backends.cpp import build
        with build.file_lock(__import__("pathlib").Path({str(directory / "build.lock")!r}), ""):
            print("locked", flush=True)
            time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    holder.kill()
    holder.wait(timeout=60)
    holder.stdout.close()
    # torch's own lock file, as a killed torch build leaves it
    (directory / "lock").write_text("")
    calls = []
    assert build.ensure_built(cfg, compile=_fake_compile(calls), load=lambda path: None).exists()
    assert len(calls) == 1


def test_no_extension_warns_once_with_the_cause(monkeypatch):
    monkeypatch.setattr(loader, "_STATUS", None)
    monkeypatch.setattr(loader, "_import_packaged", lambda: (None, "none was built with the package"))

    def no_compiler(**kwargs):
        raise build.BuildError("no C++ compiler found (c++ is not on PATH); install one (e.g. g++), then: "
                               f"{build.BUILD_COMMAND}")

    monkeypatch.setattr(build, "obtain", no_compiler)
    with pytest.warns(UserWarning, match="plain-torch reference.*no C.. compiler found") as caught:
        loaded, reason = loader.status()
    assert not loaded and "none was built with the package" in reason and build.BUILD_COMMAND in reason
    assert [pathlib.Path(w.filename).name for w in caught] == ["test_install.py"], "points at the caller"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert loader.status() == (False, reason)


def test_the_package_carries_its_sources():
    """What a first use builds from: under the installed package (a wheel or sdist install) the
    same files as the checkout's csrc/."""
    installed = build.sources_dir()
    assert installed is not None and (installed / "module.cpp").is_file()
    if (ROOT / "csrc").is_dir():
        def listing(folder):
            return sorted(str(path.relative_to(folder)) for path in folder.rglob("*")
                          if path.suffix in build.SOURCE_SUFFIXES)
        assert listing(installed) == listing(ROOT / "csrc")


def test_interpreter_shortcuts_only_on_checked_triton():
    pytest.importorskip("triton")
    assert triton_interpreter.install("0.0.0") == ()
    assert "3.9.0" in triton_interpreter.VERIFIED_TRITON
