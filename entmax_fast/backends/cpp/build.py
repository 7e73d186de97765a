"""Builds the C++ extension on first use, against the torch that is running, into a per-user
cache; ``python -m entmax_fast.backends.cpp.build`` does it ahead of time (and retries one
that failed).

Why on first use: the extension is written against ATen's C++ API (csrc/), whose binary
interface changes with every torch release, so a compiled extension fits one torch only; and
``pip install`` builds in an isolated environment without the user's torch. The package
therefore ships its sources (``entmax_fast/csrc`` in a wheel or sdist; ``csrc/`` in a checkout)
and compiles them with ``torch.utils.cpp_extension`` and ninja the first time an op asks for
the extension in a process that has none built in place.

The cache (``$ENTMAX_FAST_CACHE_DIR``, else ``$XDG_CACHE_HOME/entmax_fast``, else
``~/.cache/entmax_fast``) has one directory per build key: torch's version and commit, its
CUDA version where CUDA is built, Python's ABI, the compiler, the flags and the sources' bytes.
A new torch, Python, compiler or source change gets a new directory, never a stale library.
A file lock per directory makes concurrent first calls from several processes build once: the
others wait, then load what it built. A build is done when its ``READY`` file names the
library (written last, atomically); a build that failed leaves ``FAILED`` with the compiler's
output, so that later processes report it instead of compiling again for minutes.

This module imports nothing of the package, and torch only inside functions, so that
setup.py can read the flags from it.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib
import platform
import shutil
import sys
import sysconfig
from dataclasses import dataclass

CXX_FLAGS = ["-O3", "-std=c++20", "-fopenmp"]
NVCC_FLAGS = ["-O3", "-std=c++17"]
LD_FLAGS = ["-fopenmp"]
CUDA_DEFINE = "-DENTMAX_FAST_WITH_CUDA"
SOURCE_SUFFIXES = (".cpp", ".cu", ".h", ".cuh", ".inc")
LIBRARY_NAME = "entmax_fast_C"
# Raised when the way of building changes, so that libraries built the old way are not reused.
BUILDER_VERSION = "1"

BUILD_COMMAND = "python -m entmax_fast.backends.cpp.build"
ENV_BUILD_ON_USE = "ENTMAX_FAST_BUILD_ON_USE"
ENV_CACHE_DIR = "ENTMAX_FAST_CACHE_DIR"


class BuildError(RuntimeError):
    """The extension could not be built; the message says why and the fix, in one sentence."""


@dataclass(frozen=True)
class Config:
    """One build: its sources, whether with the CUDA operators, and the key that hashes
    everything it depends on (read when the config is made)."""

    sources_dir: pathlib.Path
    sources: tuple[pathlib.Path, ...]
    with_cuda: bool
    # Why the CUDA operators are not built ("" when they are).
    cuda_absent: str
    key: str


def _key(source_root: pathlib.Path, identity: tuple) -> str:
    digest = hashlib.sha256()
    for part in identity:
        digest.update(str(part).encode() + b"\0")
    for path in sorted(source_root.rglob("*")):
        if path.is_file() and path.suffix in SOURCE_SUFFIXES:
            digest.update(str(path.relative_to(source_root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def sources_dir() -> pathlib.Path | None:
    """The C++ sources: inside the installed package, else in the checkout beside it."""
    package = pathlib.Path(__file__).resolve().parents[2]
    for candidate in (package / "csrc", package.parent / "csrc"):
        if (candidate / "module.cpp").is_file():
            return candidate
    return None


def cuda_toolkit() -> tuple[str | None, str]:
    """(nvcc, "") when the CUDA operators can be built, else (None, why not). torch guesses a
    CUDA_HOME even where no toolkit is installed, so nvcc itself is looked for."""
    import torch

    if torch.version.cuda is None:
        return None, "torch is a CPU build"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None:
        return None, f"torch is a CUDA {torch.version.cuda} build, but no CUDA toolkit was found (no nvcc on PATH, CUDA_HOME unset)"
    nvcc = pathlib.Path(CUDA_HOME, "bin", "nvcc.exe" if sys.platform == "win32" else "nvcc")
    if not os.access(nvcc, os.X_OK):
        return None, f"torch is a CUDA {torch.version.cuda} build, but {nvcc} does not exist (CUDA_HOME={CUDA_HOME})"
    return str(nvcc), ""


def compiler() -> str | None:
    """The C++ compiler torch.utils.cpp_extension will call ($CXX, else c++)."""
    return shutil.which(os.environ.get("CXX", "c++"))


def config(with_cuda: bool | None = None) -> Config:
    """The build of the running torch; ``with_cuda`` None: with CUDA where nvcc is found."""
    import torch

    source_root = sources_dir()
    if source_root is None:
        raise BuildError("the C++ sources are not installed with the package (no entmax_fast/csrc); "
                         "reinstall it from a source tree or sdist: pip install --force-reinstall <checkout or sdist>")
    nvcc, cuda_absent = cuda_toolkit()
    if with_cuda is None:
        with_cuda = nvcc is not None
    elif not with_cuda and not cuda_absent:
        cuda_absent = "the build with nvcc failed"
    suffixes = (".cpp", ".cu") if with_cuda else (".cpp",)
    sources = tuple(sorted(path for path in source_root.rglob("*") if path.suffix in suffixes))
    # torch.utils.cpp_extension names each object file after its source's file name alone.
    objects = [path.stem + (".cuda" if path.suffix == ".cu" else "") for path in sources]
    clashes = sorted({str(path.relative_to(source_root)) for path, name in zip(sources, objects)
                      if objects.count(name) > 1})
    if clashes:
        raise BuildError(f"sources whose object files would clash (one name, two folders): {clashes}; "
                         "rename one of each pair")
    identity = (BUILDER_VERSION, torch.__version__, torch.version.git_version, torch.version.cuda if with_cuda else "",
                sys.implementation.cache_tag, sysconfig.get_config_var("EXT_SUFFIX"), platform.machine(),
                compiler(), nvcc if with_cuda else "", os.environ.get("TORCH_CUDA_ARCH_LIST", ""),
                *build_flags(with_cuda).values(),
                *(str(path.relative_to(source_root)) for path in sources))
    return Config(source_root, sources, with_cuda, cuda_absent, _key(source_root, identity))


def build_flags(with_cuda: bool) -> dict:
    """Fresh lists: torch.utils.cpp_extension appends its own flags to the ones it is given."""
    return {"extra_cflags": CXX_FLAGS + ([CUDA_DEFINE] if with_cuda else []),
            "extra_cuda_cflags": NVCC_FLAGS + [CUDA_DEFINE] if with_cuda else [],
            "extra_ldflags": list(LD_FLAGS)}


def cuda_arch_flags() -> list:
    """nvcc's architectures where torch would find none: with no GPU visible and
    $TORCH_CUDA_ARCH_LIST unset, torch's own list fails (an empty list), so the extension is
    compiled for the architectures torch itself was built for. Empty otherwise (torch's choice)."""
    import torch

    if os.environ.get("TORCH_CUDA_ARCH_LIST") or torch.cuda.device_count():
        return []
    archs = [arch.removeprefix("sm_") for arch in torch.cuda.get_arch_list()]
    archs = [arch for arch in archs if arch.isdigit()]
    flags = [f"-gencode=arch=compute_{arch},code=sm_{arch}" for arch in archs]
    return flags + [f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}"] if archs else flags


def cache_root() -> pathlib.Path:
    if os.environ.get(ENV_CACHE_DIR):
        return pathlib.Path(os.environ[ENV_CACHE_DIR])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base, "entmax_fast")


def build_dir(cfg: Config) -> pathlib.Path:
    import torch

    torch_version = "".join(c if c.isalnum() or c in ".-" else "-" for c in torch.__version__)
    return cache_root() / f"torch{torch_version}-{sys.implementation.cache_tag}-{cfg.key}"


@contextlib.contextmanager
def file_lock(path: pathlib.Path, waiting_message: str):
    """An exclusive lock on ``path`` between processes, released by the system when its holder
    dies (a crashed build never blocks the next). Says ``waiting_message`` on stderr if another
    process holds it."""
    with open(path, "a+b") as handle:
        if sys.platform == "win32":
            import msvcrt
            import time

            told = False
            while True:
                try:
                    handle.seek(0)
                    msvcrt.locking(handle.fileno(), msvcrt.LK_NBLCK, 1)
                    break
                except OSError:
                    if not told:
                        print(waiting_message, file=sys.stderr, flush=True)
                        told = True
                    time.sleep(1.0)
            try:
                yield
            finally:
                handle.seek(0)
                msvcrt.locking(handle.fileno(), msvcrt.LK_UNLCK, 1)
        else:
            import fcntl

            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(waiting_message, file=sys.stderr, flush=True)
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _write_atomically(path: pathlib.Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(text)
    os.replace(temporary, path)


def compile_with_torch(cfg: Config, directory: pathlib.Path) -> pathlib.Path:
    """Compiles ``cfg`` with torch.utils.cpp_extension and ninja in ``directory``; returns the
    library (loaded into this process, which registers the operators)."""
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        raise BuildError("ninja is not installed (torch compiles extensions with it): pip install ninja")
    # torch's own lock file, left behind by a build that was killed, would make this build
    # wait forever; the caller holds the directory's lock, so no build is running.
    (directory / "lock").unlink(missing_ok=True)
    flags = build_flags(cfg.with_cuda)
    if cfg.with_cuda:
        flags["extra_cuda_cflags"] += cuda_arch_flags()
    path = cpp_extension.load(LIBRARY_NAME, [str(path) for path in cfg.sources], build_directory=str(directory),
                              with_cuda=cfg.with_cuda, is_python_module=False, verbose=False,
                              extra_include_paths=[str(cfg.sources_dir)], **flags)
    return pathlib.Path(path)


def load_library(path: pathlib.Path) -> None:
    import torch

    torch.ops.load_library(str(path))


def ensure_built(cfg: Config, retry_failed: bool = False, compile=compile_with_torch,
                 load=load_library) -> pathlib.Path:
    """The library of ``cfg``, loaded: found in the cache, or built now (one line on stderr)
    while other processes wait. Raises BuildError naming the cause and the fix; a failure is
    remembered in the cache (``retry_failed`` builds again anyway)."""
    directory = build_dir(cfg)
    ready, failed = directory / "READY", directory / "FAILED"
    if ready.exists() and not pathlib.Path(ready.read_text().strip()).exists():
        ready.unlink(missing_ok=True)  # its library was deleted by hand: build again
    if not ready.exists() and not (failed.exists() and not retry_failed):
        if os.environ.get(ENV_BUILD_ON_USE, "1") == "0":
            raise BuildError(f"{ENV_BUILD_ON_USE}=0 forbids building it on first use; build it once: "
                             f"{BUILD_COMMAND}")
        directory.mkdir(parents=True, exist_ok=True)
        with file_lock(directory / "build.lock",
                       f"entmax_fast: waiting for another process building the C++ extension in {directory}"):
            if not ready.exists() and (retry_failed or not failed.exists()):
                return _build_locked(cfg, directory, compile)
    if ready.exists():
        library = pathlib.Path(ready.read_text().strip())
        load(library)
        return library
    raise BuildError(f"building it failed ({_first_line(failed.read_text())}; full output: {failed}); "
                     f"fix the cause, then rebuild: {BUILD_COMMAND}")


def _build_locked(cfg: Config, directory: pathlib.Path, compile) -> pathlib.Path:
    if compiler() is None:
        raise BuildError(f"no C++ compiler found ({os.environ.get('CXX', 'c++')} is not on PATH); install one "
                         f"(e.g. g++), then: {BUILD_COMMAND}")
    import torch

    what = "CPU and CUDA operators" if cfg.with_cuda else "CPU operators"
    print(f"entmax_fast: building the C++ extension ({what}) for torch {torch.__version__} in {directory}; "
          "once per torch version, takes minutes", file=sys.stderr, flush=True)
    (directory / "FAILED").unlink(missing_ok=True)
    try:
        library = compile(cfg, directory)
    except BuildError:
        raise
    except Exception as exc:  # noqa: BLE001 - the compiler's output is in the message, kept for the report
        _write_atomically(directory / "FAILED", f"{type(exc).__name__}: {exc}\n")
        raise BuildError(f"building it failed ({type(exc).__name__}; compiler output: {directory / 'FAILED'}); "
                         f"fix the cause, then rebuild: {BUILD_COMMAND}") from exc
    _write_atomically(directory / "READY", f"{library}\n")
    return library


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0][:300] if text.strip() else "no output"


def obtain(retry_failed: bool = False, compile=compile_with_torch, load=load_library) -> tuple[pathlib.Path, str]:
    """(library, why the CUDA operators are absent or "") for the running torch, loaded. With
    nvcc the CPU and CUDA operators are built together; if that build fails, the CPU
    operators alone (a CUDA toolkit that does not fit torch must not cost the CPU kernels)."""
    cfg = config()
    if not cfg.with_cuda:
        return ensure_built(cfg, retry_failed, compile, load), cfg.cuda_absent
    try:
        return ensure_built(cfg, retry_failed, compile, load), ""
    except BuildError as exc:
        cuda_failure = str(exc)
    cpu_only = config(with_cuda=False)
    return ensure_built(cpu_only, retry_failed, compile, load), f"the build with nvcc failed: {cuda_failure}"


def main(argv=None) -> int:
    """Builds (or finds) the extension for the running torch, retrying a build that failed
    before, and says where it is."""
    import argparse

    parser = argparse.ArgumentParser(prog=BUILD_COMMAND, description=main.__doc__)
    parser.parse_args(argv)
    os.environ[ENV_BUILD_ON_USE] = "1"
    try:
        library, cuda_absent = obtain(retry_failed=True)
    except BuildError as exc:
        print(f"entmax_fast: the C++ extension is unavailable: {exc}", file=sys.stderr)
        return 1
    print(f"entmax_fast: C++ extension ready: {library}")
    if cuda_absent:
        print(f"entmax_fast: without its CUDA operators: {cuda_absent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
