# dion3 — PyTorch front end of the dion3 engine: Dion3, Dion2, NorMuon and Muon as torch.optim
# optimizers (AdamW / Lion for the element-wise parameter groups), and param_groups().
"""dion3: the Dion3 optimizer (and Dion2 / NorMuon / Muon) for PyTorch, computed by a C++/CUDA engine.

    import dion3
    opt = dion3.Dion3(dion3.param_groups(model, elementwise_options={"lr": 3e-4}), lr=0.01, fraction=0.25)

Constructor arguments follow the reference package `dion` (``dion.Dion3`` / ``dion.NorDion2``,
``dion.Dion2``, ``dion.NorMuon``, ``dion.Muon``), so moving over is an import change. Extra arguments: ``orthogonalizer`` ("auto",
"standard", "gram"; ``use_gram_newton_schulz=True`` maps to "gram"), ``scale_lr_by_fraction``,
``workspace_limit`` (bytes), ``on_nonfinite`` ("raise": a NaN/Inf gradient raises ``dion3.NonFiniteError`` and changes nothing;
"skip": the step is dropped and counted in ``opt.steps_skipped``), ``momentum_dtype``,
``iteration_dtype``, ``coefficients`` and ``restarts``. Parameter groups take
``algorithm="dion3"|"nordion2"|"dion2"|"normuon"|"muon"|"adamw"|"lion"``. ``group["lr"]`` is read before
every step and never written. Parameters whose ``.grad`` is None are skipped. One optimizer steps
parameters of one device (cpu, or one cuda device on the current stream). ``distributed_mesh``:
a ProcessGroup (DDP) or a DeviceMesh (FSDP2, FSDP2 + TP), as in the reference (docs/distributed.md).
"""
from importlib import metadata as _metadata

import torch  # noqa: F401  (loads libc10/libtorch, which dion3._C links against)

try:
    from . import _C
except ImportError as e:  # else Python reports a "partially initialized module" (circular import)
    import glob as _glob
    import os as _os
    _built = _glob.glob(_os.path.join(_os.path.dirname(__file__), "_C*"))
    if _built and "cannot open shared object file" in str(e):
        # Built and installed, but a library it links is not on this machine (the BLAS, mostly).
        raise ImportError(f"dion3: the compiled extension dion3._C does not load ({e}): a library it was "
                          "linked against is missing here; install it (OpenBLAS by default: Debian/Ubuntu "
                          "libopenblas0) or put its directory on LD_LIBRARY_PATH") from None
    raise ImportError("dion3: the compiled extension dion3._C " +
                      (f"does not load ({e})" if _built else "is missing") +
                      "; build and install the package from the repository with `pip install "
                      "--no-build-isolation .` (scripts/setup-python.sh does it), in the environment whose "
                      "PyTorch it is built against") from None
from . import cuda_graph, optim
from .groups import param_groups
from .optimizer import ALGORITHMS, Dion2, Dion3, Muon, NonFiniteError, NorDion2, NorMuon
from .polar import orthogonalize

__all__ = ["Dion3", "NorDion2", "Dion2", "NorMuon", "Muon", "NonFiniteError", "param_groups", "orthogonalize", "ALGORITHMS", "cuda_built", "optim"]
# The version has one home, the repository's VERSION file; the installed metadata carries it.
__version__ = _metadata.version("dion3")


def cuda_built() -> bool:
    """Whether this build of dion3 has the CUDA backend."""
    return _C.cuda_built()
