# polar.py — dion3.orthogonalize: the engine's Newton–Schulz (standard, or Gram with restarts, on
# the CUDA backend's symmetric kernels) for any caller, e.g. as a Muon implementation's
# orthogonalization step.
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch

from . import _C
from .optimizer import _engine_config


def orthogonalize(X: torch.Tensor, method: str = "auto", *, coefficients: Optional[Union[str, Sequence[Tuple[float, float, float]]]] = None,
                  restarts: Optional[Sequence[int]] = None, iteration_dtype: Optional[torch.dtype] = None,
                  use_polar_express: bool = True) -> torch.Tensor:
    """The approximate polar factor (U V^T of X = U S V^T) of a matrix, or of each matrix of a
    batch (rows x cols, or batch x rows x cols), by Newton–Schulz as the optimizers run it
    (algorithm.md §2): X is scaled by its Frobenius norm, then each (a, b, c) step maps X to
    a X + b (X X^T) X + c (X X^T)^2 X. Returns a new tensor of X's dtype on X's device (CUDA: on
    the current stream). Inputs are not checked for NaN or Inf (the optimizers check theirs): a
    matrix holding one comes back all NaN, the batch's others as they would alone.

    method: "auto" (the cheaper of the two for the shape, by the backend's cost model; standard
        where Gram would iterate in bfloat16, or where the coefficients and restarts would let it
        diverge: algorithm.md §2),
    "standard", or "gram" (Gram Newton–Schulz, restarting at the step indices in `restarts`;
        refused where it would diverge).
    coefficients: the (a, b, c) steps, or a set by name: "polar_express" (the default; with
    `use_polar_express=False`, the "you" set), "reference" (the reference package's
    default Polar Express set), "you" (five tuned quintic steps, one (a, b, c) each). iteration_dtype: float32, float16 or bfloat16 (default: the backend's
    choice, float32 on the CPU)."""
    if not isinstance(X, torch.Tensor):
        raise TypeError(f"dion3.orthogonalize: expected a torch.Tensor, got {type(X).__name__}")
    group = dict(algorithm="dion3", lr=0.0, fraction=1.0, mu=0.0, muon_beta2=0.0, betas=(0.0, 0.0),
                 weight_decay=0.0, epsilon=1e-8, adjust_lr=None, flatten=False, nesterov=False,
                 cautious_wd=False, scale_lr_by_fraction=False, momentum_dtype=None, orthogonalizer=method,
                 coefficients=coefficients, use_polar_express=use_polar_express,
                 restarts=restarts, iteration_dtype=iteration_dtype)
    return _C.orthogonalize(X.detach(), _engine_config(group))
