# dion3.optim — optimizers with torch.optim's constructors, groups and checkpoints, stepped by the
# dion3 engine. Swapping `torch.optim.Muon` for `dion3.optim.Muon` changes nothing else in a
# training script (docs/guide.md, "From torch.optim.Muon").
"""torch.optim's Muon on the dion3 engine: ``dion3.optim.Muon`` takes ``torch.optim.Muon``'s
arguments, keeps its group keys and its momentum (an average: ``B = mu*B + (1 - mu)*G``), and saves
and loads its checkpoints in both directions. What it adds: megabatched orthogonalization on the
C++/CUDA engine, ``distributed_mesh`` (DDP, FSDP2, FSDP2 + TP), parameters of 3 or more dimensions
(stacks of matrices), and the dion3 group keys ``split_sizes`` / ``num_heads`` (fused QKV) and
``transposed`` (weights stored (in, out): adjust_lr_fn reads the (out, in) shape)."""
import math
import numbers
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from . import _C
from .optimizer import _KEY_ALIASES, ENGINE_DEFAULTS, _EngineOptimizer, _integer

__all__ = ["Muon"]

# torch.optim.Muon's adjust_lr_fn values and the engine's names for the same scalings.
_ADJUST_LR_FN = {None: "spectral_norm_clamped", "original": "spectral_norm_clamped",
                 "match_rms_adamw": "rms_norm", "spectral_unclamped": "spectral_norm"}
# The most quintic steps the engine takes.
_MAX_NS_STEPS = _C.MAX_ORTH_STEPS
# The smallest eps the engine takes (it sums the norm from squares kept in float32).
_MIN_EPS = _C.MIN_NORM_EPS


def _real(key: str, v: Any) -> float:
    """A number as torch takes it (a Python or NumPy scalar, a one-element tensor), as a float."""
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise ValueError(f"dion3: '{key}' must be a number; got {v!r}")
    return float(v)


# Settings of dion3's own optimizers that this one fixes or does not have: refused, not ignored.
_DION3_ONLY = frozenset({"fraction", "muon_beta2", "betas", "cautious_wd", "scale_lr_by_fraction", "restarts",
                         "use_gram_newton_schulz", "use_polar_express", "use_triton", "triton_post_ortho",
                         "selection_scope", "ema_momentum", "ef_decay"})
# The reference's and dion3's names for torch's keys, refused naming torch's.
_TORCH_ALIASES = dict(_KEY_ALIASES, mu=("momentum",), adjust_lr=("adjust_lr_fn",), coefficients=("ns_coefficients",),
                      epsilon=("eps",))


class Muon(_EngineOptimizer):
    """torch.optim.Muon on the dion3 engine: the same arguments, defaults and group keys (lr,
    weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn), the same
    update, and state_dicts that load both ways (state "momentum_buffer"). Changing a group's
    "momentum" between steps (a warm-up) is followed exactly.

    Differences: the Newton–Schulz iteration runs in the engine's precision (float32 on the CPU,
    16-bit on the GPU with float32 accumulation; torch's runs in bfloat16); an `eps` below
    1e-18 (the norm is summed from squares kept in float32) or past float32's range is refused, as are float64 parameters,
    ns_steps of 0 or above 16, a nesterov other than True or False (or 0 or 1), and momentum of 1 or more; a
    non-finite gradient raises dion3.NonFiniteError (on_nonfinite="skip" drops the step) where
    torch would step with it.
    Parameters of three or more dimensions are stepped as stacks of matrices over their last two.

    Keyword-only extras: distributed_mesh (a ProcessGroup for DDP, a DeviceMesh for FSDP2),
    orthogonalizer ("auto" | "standard" | "gram"), momentum_dtype, iteration_dtype,
    on_nonfinite ("raise" | "skip"), workspace_limit, megabatch and blocking, as for dion3.Muon.
    """

    _default_algorithm = "muon"
    _name = "Muon"
    _key_aliases = _TORCH_ALIASES
    _vectors_advice = "optimize 1-D tensors and scalars with another optimizer (torch.optim.AdamW, say), as with torch.optim.Muon"

    def _state_kind(self, group: Dict[str, Any]) -> str:
        return "torch_muon"  # torch's name for the buffer: momentum_buffer

    def _check_keys(self, gi: int, group: Dict[str, Any]) -> None:
        super()._check_keys(gi, group)
        if group.get("algorithm", "muon") != "muon":
            raise ValueError(f"dion3: parameter group {gi}: dion3.optim.Muon steps torch.optim.Muon's update only; "
                             f"got algorithm={group['algorithm']!r} (dion3.Dion3, NorMuon and Muon take groups of "
                             "other algorithms)")
        for key in group:
            if key in _DION3_ONLY:
                raise ValueError(f"dion3: parameter group {gi}: '{key}' is a setting of dion3's own optimizers, "
                                 "which dion3.optim.Muon (torch.optim.Muon's form) does not take; use dion3.Muon")

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: Tuple[float, float, float] = (3.4445, -4.775, 2.0315),
                 eps: float = 1e-7, ns_steps: int = 5, adjust_lr_fn: Optional[str] = None, *,
                 distributed_mesh=None, orthogonalizer: str = "auto",
                 momentum_dtype: Optional[torch.dtype] = None, iteration_dtype: Optional[torch.dtype] = None,
                 on_nonfinite: str = "raise", workspace_limit: Optional[int] = None, megabatch: bool = True,
                 blocking: Optional[bool] = None):
        # torch.optim.Muon's own checks, with its messages, before dion3's.
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if not 0.0 <= momentum:
            raise ValueError(f"momentum should be >= 0 but is: {momentum}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
        if adjust_lr_fn not in _ADJUST_LR_FN:
            raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
                        adjust_lr_fn=adjust_lr_fn,
                        # dion3's keys: the group's algorithm and layout, which torch's Muon fixes
                        algorithm=self._default_algorithm, flatten=False, split_sizes=None, num_heads=None,
                        orthogonalizer=orthogonalizer, momentum_dtype=momentum_dtype,
                        iteration_dtype=iteration_dtype)
        super().__init__(params, distributed_mesh, defaults, on_nonfinite, workspace_limit, megabatch, blocking)

    def _engine_group(self, group: Dict[str, Any]) -> Dict[str, Any]:
        """torch's keys as dion3's: momentum is mu with the averaged form, ns_coefficients taken
        ns_steps times, adjust_lr_fn's scaling by the engine's name for it."""
        momentum = _real("momentum", group["momentum"])
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"dion3: 'momentum' must lie in [0, 1); got {momentum!r}")
        steps = _integer("ns_steps", group["ns_steps"])
        if not 1 <= steps <= _MAX_NS_STEPS:
            raise ValueError(f"dion3: 'ns_steps' must lie in [1, {_MAX_NS_STEPS}] (the engine's most); got {steps}")
        abc = group["ns_coefficients"]
        if not isinstance(abc, Sequence) or len(abc) != 3:
            raise ValueError(f"dion3: 'ns_coefficients' must be three numbers (a, b, c); got {abc!r}")
        fn = group["adjust_lr_fn"]
        if not isinstance(fn, (str, type(None))) or fn not in _ADJUST_LR_FN:
            raise ValueError(f"dion3: 'adjust_lr_fn' must be None, 'original', 'match_rms_adamw' or "
                             f"'spectral_unclamped'; got {fn!r}")
        eps = _real("eps", group["eps"])
        if not _MIN_EPS <= float(torch.tensor(eps, dtype=torch.float32)) < math.inf:
            raise ValueError(f"dion3: 'eps' must be a float32 number from {_MIN_EPS:g} (the engine sums the norm "
                             f"from squares kept in float32); got {eps!r}")
        # The engine's defaults for the settings torch's Muon does not have (fraction 1: every row).
        return dict(
            ENGINE_DEFAULTS, algorithm="muon", lr=group["lr"], weight_decay=group["weight_decay"], mu=momentum, ema_momentum=True,
            nesterov=group["nesterov"], adjust_lr=_ADJUST_LR_FN[fn], flatten=group["flatten"],
            coefficients=[tuple(_real("ns_coefficients", x) for x in abc)] * steps,
            restarts=None, norm_eps=eps, norm_floor=True,  # torch divides by max(norm, eps)
            orthogonalizer=group.get("orthogonalizer", "auto"), momentum_dtype=group.get("momentum_dtype"),
            iteration_dtype=group.get("iteration_dtype"), split_sizes=group.get("split_sizes"),
            num_heads=group.get("num_heads"), transposed=group.get("transposed", False), fraction=1.0)

    def _from_saved_layout(self, state_dict: Dict[str, Any]) -> Dict[str, Any]:
        if isinstance(state_dict, dict) and isinstance(state_dict.get("state"), dict) \
                and isinstance(state_dict.get("param_groups"), list):
            theirs = [g for g in state_dict["param_groups"] if isinstance(g, dict) and "mu" in g and "momentum" not in g]
            named = [st for st in state_dict["state"].values() if isinstance(st, dict) and "momentum" in st]
            if theirs or named:
                # Their momentum may be summed, M = mu*M + G: 1 / (1 - mu) times this buffer.
                raise ValueError("dion3: this state_dict is dion3.Muon's or the reference package's (group key 'mu', "
                                 "state 'momentum'); dion3.optim.Muon keeps torch.optim.Muon's averaged momentum under "
                                 "'momentum_buffer': load it into dion3.Muon")
            # torch's Muon counts no steps, and this one reads none: a missing counter starts at 0.
            state = {i: (dict({"step": 0}, **st) if isinstance(st, dict) else st)
                     for i, st in state_dict["state"].items()}
            state_dict = dict(state_dict, state=state)
        return super()._from_saved_layout(state_dict)
