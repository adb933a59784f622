# setup.py — builds dion3._C, the PyTorch extension: the C++ core (src/core, src/cpu), the CUDA
# backend (src/cuda) when building with CUDA, and the binding (python/dion3/csrc).
#
# The source lists are globbed from the tree so that they follow the CMake build without a second
# hand-kept list. CUDA is on when DION3_CUDA=1, off when DION3_CUDA=0, and otherwise on when the
# installed torch sees a GPU and nvcc is found. Objects go to build-py-ext/ (persistent, so a
# rebuild is incremental under ninja); MAX_JOBS bounds the parallel compiles (default 2).
import glob
import os

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("MAX_JOBS", "2")


def rel(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def want_cuda():
    import torch
    from torch.utils import cpp_extension

    flag = os.environ.get("DION3_CUDA", "auto").lower()
    have_nvcc = cpp_extension.CUDA_HOME is not None and torch.version.cuda is not None
    if flag in ("1", "on", "true", "yes"):
        if not have_nvcc:
            raise RuntimeError("DION3_CUDA=1 but torch has no CUDA or nvcc (CUDA_HOME) was not found")
        return True
    if flag in ("0", "off", "false", "no"):
        return False
    return have_nvcc and torch.cuda.is_available()


def extension():
    from torch.utils import cpp_extension

    cuda = want_cuda()
    sources = rel("src/core/*.cpp") + rel("src/cpu/*.cpp") + rel("src/comm/*.cpp") + rel("python/dion3/csrc/*.cpp")
    cxx = ["-O3", "-g0", "-std=c++20", "-fno-math-errno", "-Wno-unused-parameter"]  # -g0: no debug info (faster CI build)
    # The CPU backend's threads: OpenMP, the libgomp that PyTorch loads, so one pool serves both.
    cxx.append("-fopenmp")
    link_args = ["-fopenmp"]
    define_macros = []
    # The BLAS: OpenBLAS by default; DION3_BLAS names another library (e.g. "blas") and
    # DION3_BLAS_DIR a prefix holding its include/ and lib/ (a machine without OpenBLAS).
    libraries = [os.environ.get("DION3_BLAS", "openblas")]
    blas_dir = os.environ.get("DION3_BLAS_DIR")
    include_dirs = [os.path.join(ROOT, "include"), os.path.join(ROOT, "src")]
    library_dirs = []
    if blas_dir:
        include_dirs.append(os.path.join(blas_dir, "include"))
        library_dirs.append(os.path.join(blas_dir, "lib"))
    if cuda:
        sources = [s for s in sources if os.path.basename(s) != "no_cuda.cpp"]
        sources += rel("src/cuda/*.cu") + rel("src/cuda/*.cpp")
        define_macros.append(("DION3_HAVE_CUDA", "1"))
        libraries += ["cublas", "cublasLt"]
        # Hopper (sm_90a: wgmma) unless the caller chose architectures.
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
        nvcc = ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo"]
        return cpp_extension.CUDAExtension(
            "dion3._C", sources, include_dirs=include_dirs, library_dirs=library_dirs,
            define_macros=define_macros, libraries=libraries, extra_link_args=link_args,
            extra_compile_args={"cxx": cxx, "nvcc": nvcc})
    return cpp_extension.CppExtension(
        "dion3._C", sources, include_dirs=include_dirs, library_dirs=library_dirs,
        define_macros=define_macros, libraries=libraries, extra_link_args=link_args,
        extra_compile_args={"cxx": cxx})


def main():
    from torch.utils.cpp_extension import BuildExtension

    setup(
        ext_modules=[extension()],
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
        options={"build": {"build_base": os.path.join(ROOT, "build-py-ext")}},
    )


main()
