"""Build script: the package always installs; the C++/CUDA extension is optional.

The extension (`entmax_fast._C`) is built from every source under `csrc/`. It is a
`CUDAExtension` when torch was built with CUDA and `CUDA_HOME` is set, else a
`CppExtension`. A failed build is reported and skipped, so `pip install` works on a
machine without a working compiler; `entmax_fast.backend_info()` then says why the
C++ backend is missing. Set `ENTMAX_FAST_NO_EXT=1` to skip the build on purpose.
"""
import glob
import os
import sys

from setuptools import setup

PACKAGES = ["entmax_fast", "entmax_fast.backends", "entmax_fast.backends.cpp", "entmax_fast.backends.reference",
            "entmax_fast.backends.triton", "entmax_fast.continuous",
            "entmax_fast.reference", "entmax_fast.triton_kernels"]
# `triton_kernels` is a top-level folder, installed inside our namespace because the
# top-level import name `triton_kernels` belongs to another project.
PACKAGE_DIR = {"entmax_fast.triton_kernels": "triton_kernels"}


def _extension_kwargs():
    if os.environ.get("ENTMAX_FAST_NO_EXT", "0") == "1":
        print("entmax_fast: ENTMAX_FAST_NO_EXT=1, not building the C++ extension")
        return {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError as exc:
        print(f"entmax_fast: torch not importable at build time ({exc}); no C++ extension")
        return {}

    cpp_sources = sorted(glob.glob("csrc/**/*.cpp", recursive=True))
    cuda_sources = sorted(glob.glob("csrc/**/*.cu", recursive=True))
    if not cpp_sources:
        return {}
    with_cuda = torch.version.cuda is not None and CUDA_HOME is not None
    cxx_flags = ["-O3", "-std=c++20", "-fopenmp"] if sys.platform != "win32" else ["/O2"]
    if with_cuda:
        ext = CUDAExtension(
            "entmax_fast._C",
            cpp_sources + cuda_sources,
            extra_compile_args={"cxx": cxx_flags + ["-DENTMAX_FAST_WITH_CUDA"],
                                "nvcc": ["-O3", "-std=c++17", "-DENTMAX_FAST_WITH_CUDA"]},
            extra_link_args=["-fopenmp"],
        )
    else:
        ext = CppExtension("entmax_fast._C", cpp_sources, extra_compile_args=cxx_flags,
                           extra_link_args=["-fopenmp"])

    class OptionalBuildExtension(BuildExtension):
        """Builds the extension, but never fails the install because of it."""

        def run(self):
            try:
                super().run()
            except Exception as exc:  # noqa: BLE001 - any compiler failure must not block install
                print(f"entmax_fast: C++ extension not built ({type(exc).__name__}: {exc}); "
                      "the package works without it (reference/Triton backends)")

        def build_extension(self, extension):
            try:
                super().build_extension(extension)
            except Exception as exc:  # noqa: BLE001
                print(f"entmax_fast: C++ extension not built ({type(exc).__name__}: {exc}); "
                      "the package works without it (reference/Triton backends)")

    return {"ext_modules": [ext], "cmdclass": {"build_ext": OptionalBuildExtension.with_options(use_ninja=True)}}


setup(
    name="entmax_fast",
    version="0.1.0",
    description="Sparse (entmax) attention for PyTorch: Triton kernels, C++ ops, exact references",
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    python_requires=">=3.10",
    install_requires=["torch>=2.4"],
    extras_require={"triton": ["triton>=3.1"], "test": ["pytest", "entmax==1.3", "numpy", "scipy"]},
    **_extension_kwargs(),
)
