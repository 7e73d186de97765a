"""Build script: the package always installs, with its C++ sources; the compiled extension is
built here only where torch is importable.

The C++ sources (`csrc/`) ship inside the package as `entmax_fast/csrc`, so that the
extension can be built on first use against the torch that is running
(entmax_fast/backends/cpp/build.py). That is what a plain `pip install <checkout or sdist>`
gives: pip builds in an isolated environment without torch, so no extension is built here
and the wheel is pure Python.

Where torch is importable (`pip install --no-build-isolation`, `python setup.py build_ext
--inplace` as scripts/setup.sh runs it), the extension `entmax_fast._C` is built now from every
source under `csrc/`: with the CUDA operators where torch is a CUDA build and nvcc exists,
else the CPU operators alone. A failed build is reported and skipped (the first use then
builds or explains). `ENTMAX_FAST_NO_EXT=1` skips it on purpose.
"""
import glob
import importlib.util
import os
import pathlib
import sys

from setuptools import setup

PACKAGES = ["entmax_fast", "entmax_fast.backends", "entmax_fast.backends.cpp", "entmax_fast.backends.reference",
            "entmax_fast.backends.triton", "entmax_fast.continuous",
            "entmax_fast.reference", "entmax_fast.triton_kernels", "entmax_fast.csrc"]
# `triton_kernels` is a top-level folder, installed inside our namespace because the
# top-level import name `triton_kernels` belongs to another project; `csrc` likewise, as data.
PACKAGE_DIR = {"entmax_fast.triton_kernels": "triton_kernels", "entmax_fast.csrc": "csrc"}
PACKAGE_DATA = {"entmax_fast.csrc": ["*.cpp", "**/*.cpp", "**/*.cu", "**/*.h", "**/*.cuh", "**/*.inc"]}


def _build_module():
    """entmax_fast/backends/cpp/build.py (the flags), loaded without importing the package."""
    path = pathlib.Path(__file__).resolve().parent / "entmax_fast" / "backends" / "cpp" / "build.py"
    spec = importlib.util.spec_from_file_location("_entmax_fast_build", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _extension_kwargs():
    if os.environ.get("ENTMAX_FAST_NO_EXT", "0") == "1":
        print("entmax_fast: ENTMAX_FAST_NO_EXT=1, not building the C++ extension")
        return {}
    try:
        import torch  # noqa: F401
        from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
    except ImportError as exc:
        print(f"entmax_fast: torch not importable at build time ({exc}); the C++ extension will be built on "
              "first use instead")
        return {}

    build = _build_module()
    cpp_sources = sorted(glob.glob("csrc/**/*.cpp", recursive=True))
    cuda_sources = sorted(glob.glob("csrc/**/*.cu", recursive=True))
    if not cpp_sources:
        return {}
    nvcc, cuda_absent = build.cuda_toolkit()
    flags = build.build_flags(with_cuda=nvcc is not None)
    if nvcc is not None:
        ext = CUDAExtension("entmax_fast._C", cpp_sources + cuda_sources,
                            extra_compile_args={"cxx": flags["extra_cflags"],
                                                "nvcc": flags["extra_cuda_cflags"] + build.cuda_arch_flags()},
                            extra_link_args=flags["extra_ldflags"])
    else:
        print(f"entmax_fast: building the C++ extension without its CUDA operators: {cuda_absent}")
        ext = CppExtension("entmax_fast._C", cpp_sources, extra_compile_args=flags["extra_cflags"],
                           extra_link_args=flags["extra_ldflags"])

    class OptionalBuildExtension(BuildExtension):
        """Builds the extension, but never fails the install because of it."""

        def run(self):
            try:
                super().run()
            except Exception as exc:  # noqa: BLE001 - any compiler failure must not block install
                print(f"entmax_fast: C++ extension not built ({type(exc).__name__}: {exc}); "
                      "the first use will try to build it and say why if it cannot")

        def build_extension(self, extension):
            try:
                super().build_extension(extension)
            except Exception as exc:  # noqa: BLE001
                print(f"entmax_fast: C++ extension not built ({type(exc).__name__}: {exc}); "
                      "the first use will try to build it and say why if it cannot")

    return {"ext_modules": [ext], "cmdclass": {"build_ext": OptionalBuildExtension.with_options(use_ninja=True)}}


setup(
    name="entmax_fast",
    version="0.1.0",
    description="Sparse (entmax) attention for PyTorch: Triton kernels, C++ ops, exact references",
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    package_data=PACKAGE_DATA,
    python_requires=">=3.10",
    # The lowest torch whose CPU tests were run (docs/install.md); ninja builds the
    # extension on first use.
    install_requires=["torch>=2.12", "ninja"],
    extras_require={"triton": ["triton>=3.1"], "test": ["pytest", "entmax==1.3", "numpy", "scipy"]},
    **_extension_kwargs(),
)
