# setup.py — builds dion3._C, the PyTorch extension: the C++ core (src/core, src/cpu), the CUDA
# backend (src/cuda) when building with CUDA, and the binding (python/dion3/csrc). Run through
# pip (`pip install .`, see pyproject.toml), which uses the in-tree backend in tools/build-backend.
#
# The source lists are globbed from the tree so that they follow the CMake build without a second
# hand-kept list. Objects go to build-py-ext/ (persistent, so a rebuild is incremental under
# ninja); MAX_JOBS bounds the parallel compiles (default 2). The CUDA backend is an explicit
# choice, reported in the build output and in dion3/_build_info.py (`python -m dion3` prints it):
#   DION3_CUDA=1      build it; fails when PyTorch has no CUDA or nvcc (CUDA_HOME) is not found
#   DION3_CUDA=0      do not build it
#   unset / auto      build it when nvcc is found and PyTorch sees a GPU; nvcc without a visible
#                     GPU builds the CPU backend only and says so (DION3_CUDA=1 forces CUDA)
# TORCH_CUDA_ARCH_LIST picks the GPU architectures (default 9.0a: Hopper, for wgmma).
import glob
import os
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("MAX_JOBS", "2")
DEFAULT_CUDA_ARCHS = "9.0a"


def rel(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def report(line):
    # stderr: pip shows it with -v, and always when the build fails.
    print(f"dion3 build: {line}", file=sys.stderr, flush=True)


def import_torch():
    try:
        import torch
    except ImportError as e:
        raise SystemExit(
            f"dion3: PyTorch is not importable by {sys.executable} ({e}); dion3 builds against the "
            "installed PyTorch: install PyTorch first, then `pip install .`") from None
    return torch


def want_cuda():
    """(build CUDA?, why) from DION3_CUDA, the PyTorch build, nvcc and the visible GPUs."""
    torch = import_torch()
    from torch.utils import cpp_extension

    raw = os.environ.get("DION3_CUDA", "")
    flag = raw.strip().lower()
    if flag not in ("", "auto", "1", "on", "true", "yes", "0", "off", "false", "no"):
        raise SystemExit(f"dion3: DION3_CUDA={raw!r} is not one of 1/on/true/yes, 0/off/false/no or auto")
    label = f"DION3_CUDA={raw}" if raw else "DION3_CUDA unset"
    if flag in ("0", "off", "false", "no"):
        return False, label
    if torch.version.cuda is None:
        problem = f"the installed PyTorch {torch.__version__} has no CUDA"
    elif cpp_extension.CUDA_HOME is None or not os.path.isfile(os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")):
        problem = f"nvcc was not found (CUDA_HOME={cpp_extension.CUDA_HOME}; set CUDA_HOME or put nvcc on PATH)"
    else:
        problem = None
    if flag in ("1", "on", "true", "yes"):
        if problem:
            raise SystemExit(f"dion3: DION3_CUDA={raw} but {problem}")
        return True, label
    if problem:
        return False, f"{label} and {problem}"
    if not torch.cuda.is_available():
        report("*** nvcc found (CUDA_HOME=" + cpp_extension.CUDA_HOME + ") but PyTorch sees no GPU: "
               "building the CPU backend only. DION3_CUDA=1 builds the CUDA backend anyway "
               f"(TORCH_CUDA_ARCH_LIST picks the architectures, default {DEFAULT_CUDA_ARCHS}); "
               "DION3_CUDA=0 silences this. ***")
        return False, f"{label}, nvcc found but no GPU visible"
    return True, f"{label}, nvcc found and a GPU visible"


def check_cblas(library, include_dirs):
    """Fail at once, saying what to install, where the compiler cannot find cblas.h (the build
    would otherwise stop a minute in, at the CPU backend's first object)."""
    cxx = os.environ.get("CXX", "c++")
    flags = [f"-I{d}" for d in include_dirs]
    try:
        r = subprocess.run([cxx, "-E", "-x", "c++", "-", *flags], input="#include <cblas.h>\n",
                           capture_output=True, text=True)
    except OSError as e:
        raise SystemExit(f"dion3: no C++ compiler to build with ({cxx}: {e}); install a C++20 compiler or set CXX")
    if r.returncode != 0:
        raise SystemExit(
            f"dion3: cblas.h not found for the BLAS '{library}' ({cxx}: {(r.stderr.strip().splitlines() or [''])[-1]}); "
            "install its development files (OpenBLAS, the default: Debian/Ubuntu libopenblas-dev, "
            "Fedora openblas-devel), or name another BLAS with DION3_BLAS and its prefix with DION3_BLAS_DIR")


def extension(build_info):
    from torch.utils import cpp_extension

    torch = import_torch()
    cuda, why = want_cuda()
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
    runtime_dirs = []  # where the extension finds that BLAS when it is loaded (its rpath)
    if blas_dir:
        include_dirs.append(os.path.join(blas_dir, "include"))
        library_dirs.append(os.path.join(blas_dir, "lib"))
        runtime_dirs.append(library_dirs[-1])
    check_cblas(libraries[0], include_dirs)
    if cuda:
        sources = [s for s in sources if os.path.basename(s) != "no_cuda.cpp"]
        sources += rel("src/cuda/*.cu") + rel("src/cuda/*.cpp")
        define_macros.append(("DION3_HAVE_CUDA", "1"))
        libraries += ["cublas", "cublasLt"]
        # Hopper (sm_90a: wgmma) unless the caller chose architectures.
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
        archs = os.environ["TORCH_CUDA_ARCH_LIST"]
        report(f"backends: cpu, cuda (architectures {archs}; {why}); PyTorch {torch.__version__}, CUDA {torch.version.cuda}")
        build_info.update(backends=("cpu", "cuda"), cuda_archs=archs, cuda_reason=why)
        nvcc = ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo"]
        return cpp_extension.CUDAExtension(
            "dion3._C", sources, include_dirs=include_dirs, library_dirs=library_dirs,
            runtime_library_dirs=runtime_dirs, define_macros=define_macros, libraries=libraries,
            extra_link_args=link_args, extra_compile_args={"cxx": cxx, "nvcc": nvcc})
    report(f"backends: cpu ({why}); PyTorch {torch.__version__}")
    build_info.update(backends=("cpu",), cuda_archs="", cuda_reason=why)
    return cpp_extension.CppExtension(
        "dion3._C", sources, include_dirs=include_dirs, library_dirs=library_dirs,
        runtime_library_dirs=runtime_dirs, define_macros=define_macros, libraries=libraries,
        extra_link_args=link_args, extra_compile_args={"cxx": cxx})


class BuildPyWithInfo(build_py):
    """build_py that also writes dion3/_build_info.py: what this build holds."""

    build_info = {}

    def run(self):
        # build_lib persists between builds (build-py-ext/): a module since deleted from the sources
        # would otherwise ship in the next wheel.
        built = os.path.join(self.build_lib, "dion3")
        sources = self.get_package_dir("dion3")
        if not self.dry_run and os.path.isdir(built):
            for name in os.listdir(built):
                if name.endswith(".py") and name != "_build_info.py" and not os.path.exists(os.path.join(sources, name)):
                    os.remove(os.path.join(built, name))
        super().run()
        if not self.dry_run and self.build_info:
            path = os.path.join(self.build_lib, "dion3", "_build_info.py")
            with open(path, "w") as f:
                f.write("# Generated by setup.py: what this build of dion3 holds.\n")
                for key, value in sorted(self.build_info.items()):
                    f.write(f"{key.upper()} = {value!r}\n")


def main():
    if os.environ.get("DION3_SDIST_ONLY") == "1":
        # An sdist (set by tools/build-backend): sources only, MANIFEST.in lists them; no PyTorch needed.
        setup(install_requires=["torch"])
        return
    torch = import_torch()
    from torch.utils.cpp_extension import BuildExtension

    info = BuildPyWithInfo.build_info
    ext = extension(info)
    info.update(torch_version=torch.__version__, torch_cuda=torch.version.cuda or "")
    # dion3._C links against this PyTorch's C++ ABI: the wheel asks for its release (any patch level).
    major_minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    setup(
        install_requires=[f"torch=={major_minor}.*"],
        ext_modules=[ext],
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True), "build_py": BuildPyWithInfo},
        options={"build": {"build_base": os.path.join(ROOT, "build-py-ext")}},
    )


main()
