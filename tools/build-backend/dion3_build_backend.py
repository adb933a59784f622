# tools/build-backend/dion3_build_backend.py — the PEP 517 build backend of the dion3 package
# (pyproject.toml points here): setuptools' backend, building against the PyTorch installed in
# the environment being installed into.
#
# dion3._C links against libtorch, so it must be compiled against the very PyTorch that will
# import it. Under pip's default build isolation the environment's packages are hidden from the
# build; a `torch` build requirement would make pip fetch a second (possibly different) PyTorch
# into a throw-away environment. This backend never asks for torch: it puts the installing
# environment's site-packages back on the path, after the isolated ones, and fails with a clear
# message when PyTorch is not there. Only setuptools (>= 77) and ninja are requested, and only
# when that environment lacks them. An sdist needs no PyTorch.
import os
import shutil
import site
import sys

MIN_SETUPTOOLS = (77, 0)


def _add_installing_environment():
    """Appends the site-packages of this interpreter's environment (and their .pth entries)."""
    for path in site.getsitepackages():
        if os.path.isdir(path) and path not in sys.path:
            site.addsitedir(path)


_add_installing_environment()


def _version_tuple(text):
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _setuptools_ok():
    try:
        import setuptools
    except ImportError:
        return False
    return _version_tuple(setuptools.__version__) >= MIN_SETUPTOOLS


def _missing_tools(with_ninja):
    need = [] if _setuptools_ok() else [f"setuptools>={MIN_SETUPTOOLS[0]}"]
    if with_ninja and shutil.which("ninja") is None:
        try:
            import ninja  # noqa: F401
        except ImportError:
            need.append("ninja")
    return need


def _require_setuptools():
    if not _setuptools_ok():
        try:
            import setuptools
            found = f"setuptools {setuptools.__version__} ({os.path.dirname(setuptools.__file__)})"
        except ImportError:
            found = "no setuptools"
        raise SystemExit(
            f"dion3: building needs setuptools >= {MIN_SETUPTOOLS[0]}, found {found} for {sys.executable}. "
            "Run `python -m pip install -U setuptools`, then build again.")


def _require_torch():
    try:
        import torch
    except ImportError as e:
        raise SystemExit(
            f"dion3: PyTorch is not importable by {sys.executable} ({e}). dion3 builds against the "
            "PyTorch installed in the environment it is installed into and never downloads one for "
            "the build: install PyTorch first (https://pytorch.org/get-started/locally/), then "
            "`pip install .` (or `pip install --no-build-isolation .`). With `python -m build`, pass "
            "--no-isolation: its isolated environment has no PyTorch.") from None
    return torch


def _backend():
    from setuptools import build_meta
    return build_meta


# ---- PEP 517 / PEP 660 hooks ----------------------------------------------------------------

def get_requires_for_build_sdist(config_settings=None):
    return _missing_tools(with_ninja=False)


def get_requires_for_build_wheel(config_settings=None):
    _require_torch()
    return _missing_tools(with_ninja=True)


def get_requires_for_build_editable(config_settings=None):
    return get_requires_for_build_wheel(config_settings)


def build_sdist(sdist_directory, config_settings=None):
    _require_setuptools()
    # setup.py then lists no extension, so making an sdist needs no PyTorch.
    os.environ["DION3_SDIST_ONLY"] = "1"
    return _backend().build_sdist(sdist_directory, config_settings)


def _require_extension_build():
    """What building dion3._C needs: setuptools, and the PyTorch it compiles against."""
    _require_setuptools()
    _require_torch()


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    _require_extension_build()
    return _backend().prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _require_extension_build()
    return _backend().build_wheel(wheel_directory, config_settings, metadata_directory)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    _require_extension_build()
    return _backend().prepare_metadata_for_build_editable(metadata_directory, config_settings)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    _require_extension_build()
    return _backend().build_editable(wheel_directory, config_settings, metadata_directory)
