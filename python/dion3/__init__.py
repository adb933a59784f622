# dion3 — PyTorch front end of the dion3 engine: Dion3, NorMuon and Muon as torch.optim
# optimizers (AdamW / Lion for the element-wise parameter groups), and param_groups().
import torch  # noqa: F401  (loads libc10/libtorch, which dion3._C links against)

from . import _C
from .groups import param_groups
from .optimizer import ALGORITHMS, Dion3, Muon, NonFiniteError, NorMuon

__all__ = ["Dion3", "NorMuon", "Muon", "NonFiniteError", "param_groups", "ALGORITHMS", "cuda_built"]
__version__ = "0.1.0"


def cuda_built() -> bool:
    """Whether this build of dion3 has the CUDA backend."""
    return _C.cuda_built()
