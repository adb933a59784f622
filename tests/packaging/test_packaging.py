# test_packaging.py — the package as users get it: one version everywhere, `pip install .` that
# needs nothing from the network (PyTorch comes from the environment), clear failures when
# PyTorch or nvcc is missing, the CUDA choice reported, and an sdist that builds a working wheel.
# Run by scripts/test-packaging.sh (outside tests/python: compiling the wheel takes minutes).
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import dion3

ROOT = Path(__file__).resolve().parents[2]
VERSION = (ROOT / "VERSION").read_text().strip()


def run(cmd, cwd, **env):
    """Runs cmd with pip kept off the network, its cache and any user configuration."""
    full_env = dict(os.environ, PIP_NO_INDEX="1", PIP_NO_CACHE_DIR="1", PIP_CONFIG_FILE=os.devnull,
                    PIP_DISABLE_PIP_VERSION_CHECK="1", **env)
    full_env.pop("PYTHONPATH", None)
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=full_env, capture_output=True, text=True)


def make_venv(path, share_packages=True):
    """A fresh virtualenv (no pip of its own). share_packages: it sees this interpreter's
    site-packages (PyTorch, pip, setuptools) through a .pth, after its own."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    if share_packages:
        purelib = subprocess.check_output(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip()
        dirs = [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)]
        Path(purelib, "zz_parent.pth").write_text("\n".join(dirs) + "\n")
    return python


def test_version_has_one_home():
    assert re.fullmatch(r"\d+\.\d+\.\d+", VERSION), VERSION
    assert dion3.__version__ == VERSION
    # The files that used to type the version by hand now read VERSION; none may type it again.
    for rel in ["CMakeLists.txt", "pyproject.toml", "setup.py", "python/dion3/__init__.py",
                "include/dion3/dion3.h", "src/capi/dion3_c.cpp"]:
        assert VERSION not in (ROOT / rel).read_text(), f"{rel} types the version {VERSION} by hand"
    assert "VERSION" in (ROOT / "CMakeLists.txt").read_text()


def test_python_m_dion3_reports_the_build():
    r = run([sys.executable, "-m", "dion3"], cwd="/")
    assert r.returncode == 0, r.stderr
    assert f"dion3 {VERSION}" in r.stdout
    backends = "backends: cpu, cuda" if dion3.cuda_built() else "backends: cpu"
    assert backends in r.stdout, r.stdout


def test_pip_install_needs_no_download(tmp_path):
    # With the index off, pip must set up the (isolated) build and resolve the install from what
    # the environment has: no second PyTorch, no build tools fetched.
    python = make_venv(tmp_path / "venv")
    r = run([python, "-m", "pip", "install", "--dry-run", "--no-index", ROOT], cwd=tmp_path, DION3_CUDA="0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"Would install dion3-{VERSION}" in r.stdout, r.stdout


def test_missing_pytorch_fails_clearly(tmp_path):
    python = make_venv(tmp_path / "bare", share_packages=False)
    hook = ("import sys; sys.path.insert(0, sys.argv[1]); import dion3_build_backend as b; "
            "print(b.{}())")
    r = run([python, "-c", hook.format("get_requires_for_build_wheel"), ROOT / "tools/build-backend"], cwd=tmp_path)
    assert r.returncode != 0
    assert "PyTorch is not importable" in r.stderr and "install PyTorch first" in r.stderr, r.stderr
    # An sdist needs no PyTorch: only the missing setuptools is asked for.
    r = run([python, "-c", hook.format("get_requires_for_build_sdist"), ROOT / "tools/build-backend"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "['setuptools>=77']"


def setup_py(**env):
    return run([sys.executable, "setup.py", "--version"], cwd=ROOT, **env)


def test_cuda_requested_without_nvcc_fails_loudly(tmp_path):
    r = setup_py(DION3_CUDA="1", CUDA_HOME=str(tmp_path / "no-cuda"))
    assert r.returncode != 0
    assert "DION3_CUDA=1 but" in r.stderr, r.stderr
    r = setup_py(DION3_CUDA="maybe")
    assert r.returncode != 0
    assert "DION3_CUDA='maybe' is not one of" in r.stderr, r.stderr


def test_missing_cblas_fails_clearly(tmp_path):
    # A compiler that finds no headers stands in for a machine without OpenBLAS's development files.
    cxx = tmp_path / "cxx-without-headers"
    cxx.write_text("#!/bin/sh\nexec c++ -nostdinc \"$@\"\n")
    cxx.chmod(0o755)
    r = setup_py(DION3_CUDA="0", CXX=str(cxx))
    assert r.returncode != 0
    assert "cblas.h not found for the BLAS 'openblas'" in r.stderr and "libopenblas-dev" in r.stderr, r.stderr


def test_cuda_choice_is_reported():
    r = setup_py(DION3_CUDA="0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == VERSION
    assert "dion3 build: backends: cpu (DION3_CUDA=0)" in r.stderr, r.stderr


def test_nvcc_without_gpu_builds_cpu_only_and_says_so():
    import torch
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    if home is None or not os.path.isfile(os.path.join(home, "bin", "nvcc")) or torch.cuda.is_available():
        pytest.skip("needs nvcc and no visible GPU")
    r = setup_py(DION3_CUDA="")
    assert r.returncode == 0, r.stderr
    assert "PyTorch sees no GPU: building the CPU backend only" in r.stderr, r.stderr
    assert "DION3_CUDA=1 builds the CUDA backend anyway" in r.stderr
    assert "backends: cpu (DION3_CUDA unset, nvcc found but no GPU visible)" in r.stderr


def test_sdist_builds_a_working_wheel(tmp_path):
    # python -m build makes the sdist; pip builds the wheel from the unpacked sdist alone, with
    # its default build isolation and no index; a fresh virtualenv installs and uses it.
    r = run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "-o", tmp_path / "dist", ROOT], cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    sdist = tmp_path / "dist" / f"dion3-{VERSION}.tar.gz"
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path / "src", filter="data")
    src = tmp_path / "src" / f"dion3-{VERSION}"

    python = make_venv(tmp_path / "venv")
    r = run([python, "-m", "pip", "wheel", "--no-deps", "-w", tmp_path / "wheels", src], cwd=tmp_path,
            DION3_CUDA="0", MAX_JOBS=os.environ.get("MAX_JOBS", "2"))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    wheels = list((tmp_path / "wheels").glob(f"dion3-{VERSION}-*.whl"))
    assert len(wheels) == 1, wheels
    with zipfile.ZipFile(wheels[0]) as whl:
        assert "dion3/py.typed" in whl.namelist(), "the wheel lacks its py.typed marker"
    # --ignore-installed: the dion3 this suite runs, visible through the .pth, stays untouched.
    r = run([python, "-m", "pip", "install", "--no-deps", "--ignore-installed", wheels[0]], cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr

    script = (
        "import sys, torch, dion3\n"
        "assert dion3.__file__.startswith(sys.prefix), dion3.__file__\n"
        "p = torch.nn.Parameter(torch.randn(8, 16))\n"
        "before = p.detach().clone()\n"
        "opt = dion3.Dion3([p], lr=0.02, fraction=0.5)\n"
        "p.grad = torch.randn(8, 16)\n"
        "opt.step()\n"
        "assert torch.isfinite(p).all() and not torch.equal(p, before)\n"
        "print(dion3.__version__, dion3.cuda_built())\n")
    r = run([python, "-c", script], cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split() == [VERSION, "False"]
    r = run([python, "-m", "dion3"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "backends: cpu; DION3_CUDA=0" in r.stdout, r.stdout
