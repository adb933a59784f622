# optimizer.py — dion3.Dion3, dion3.NorMuon and dion3.Muon: torch.optim.Optimizer adapters over
# the C++ engine (dion3._C.Engine).
#
# This layer holds no optimizer math. It validates arguments, keeps the optimizer state in
# PyTorch tensors (self.state[p], so state_dict / load_state_dict / torch.save work), registers
# the parameters that have a gradient with the engine (rebuilt lazily when that set, the groups or
# the state objects change), rebinds the gradients and pushes each group's hyper-parameters into
# the engine before every step. group["lr"] is only read, never written, so lr schedulers and
# hand-written schedules compose as with any torch optimizer.
from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from . import _C
from . import distributed as _dist

NonFiniteError = _C.NonFiniteError

MATRIX_ALGORITHMS = ("dion3", "nordion2", "normuon", "muon")
ELEMENTWISE_ALGORITHMS = ("adamw", "lion")
ALGORITHMS = MATRIX_ALGORITHMS + ELEMENTWISE_ALGORITHMS
_ORTHOGONALIZERS = ("auto", "standard", "gram")
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Quintic Newton–Schulz coefficient sets (SPEC §2), for the reference's use_polar_express flag.
POLAR_EXPRESS = [
    (7.892582874424408, -20.383013945879568, 13.555306149406924),
    (3.911484868135431, -2.546463592906088, 0.426898831967307),
    (3.760657955697423, -2.512819018216563, 0.432364734907007),
    (3.160399673686287, -2.149649518898498, 0.399636690766439),
    (2.191097161861730, -1.441662010214663, 0.328146487623155),
]
YOU = [
    (4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012),
]


def _dtype_name(dtype) -> Optional[str]:
    if dtype is None:
        return None
    if isinstance(dtype, str):
        return dtype
    return str(dtype).replace("torch.", "")


def _engine_config(group: Dict[str, Any]) -> Dict[str, Any]:
    """The normalised dict dion3._C reads (one fixed set of keys, plain Python values)."""
    algorithm = group["algorithm"]
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        raise ValueError(f"dion3: 'algorithm' must be one of {', '.join(ALGORITHMS)}; got {algorithm!r}")
    orth = group["orthogonalizer"]
    if orth not in _ORTHOGONALIZERS:
        raise ValueError(f"dion3: 'orthogonalizer' must be 'auto', 'standard' or 'gram'; got {orth!r}")
    if orth == "auto" and group.get("use_gram_newton_schulz", False):
        orth = "gram"  # the reference's flag maps onto our explicit argument
    coefficients = group.get("coefficients")
    if coefficients is None:
        coefficients = POLAR_EXPRESS if group.get("use_polar_express", True) else YOU
    restarts = group.get("restarts")
    if restarts is None:
        restarts = [2]
    betas = group["betas"]
    if len(betas) != 2:
        raise ValueError(f"dion3: 'betas' must be a pair (beta1, beta2); got {betas!r}")
    adjust_lr = group["adjust_lr"]
    cfg = {
        "algorithm": algorithm,
        "lr": float(group["lr"]),
        "fraction": float(group["fraction"]),
        "mu": float(group["mu"]),
        "muon_beta2": float(group["muon_beta2"]),
        "beta1": float(betas[0]),
        "beta2": float(betas[1]),
        "weight_decay": float(group["weight_decay"]),
        "epsilon": float(group["epsilon"]),
        "adjust_lr": "none" if adjust_lr is None else str(adjust_lr),
        "flatten": bool(group["flatten"]),
        "nesterov": bool(group["nesterov"]),
        "cautious_wd": bool(group["cautious_wd"]),
        "scale_lr_by_fraction": bool(group["scale_lr_by_fraction"]),
        "momentum_dtype": _dtype_name(group.get("momentum_dtype")),
        "orthogonalizer": orth,
        "coefficients": [tuple(float(x) for x in step) for step in coefficients],
        "restarts": [int(r) for r in restarts],
        "iteration_dtype": _dtype_name(group.get("iteration_dtype")),
        "selection_scope": str(group.get("selection_scope", "local")),
    }
    return cfg


def _state_shapes(group: Dict[str, Any], p: torch.Tensor) -> List[Tuple[str, torch.dtype, Tuple[int, ...]]]:
    """State tensors the engine expects for p (it checks them again: a mismatch is its error)."""
    algorithm = group["algorithm"]
    if algorithm in MATRIX_ALGORITHMS:
        mdt = group.get("momentum_dtype")
        mdt = getattr(torch, mdt) if isinstance(mdt, str) else (mdt or p.dtype)
        out = [("momentum", mdt, tuple(p.shape))]
        if algorithm != "muon":
            rows = p.shape[0] if (group["flatten"] or p.dim() == 2) else p.numel() // p.shape[-1]
            out.append(("variance", torch.float32, (rows,)))
        return out
    if algorithm == "adamw":
        return [("exp_avg", p.dtype, tuple(p.shape)), ("exp_avg_sq", p.dtype, tuple(p.shape))]
    return [("exp_avg", p.dtype, tuple(p.shape))]


# Group keys whose change alters the engine's registration (everything else is pushed per step).
def _structure_key(group: Dict[str, Any]) -> Tuple:
    return (group["algorithm"], bool(group["flatten"]), _dtype_name(group.get("momentum_dtype")))


class _EngineOptimizer(torch.optim.Optimizer):
    """Common machinery of Dion3, NorMuon and Muon (not public)."""

    _default_algorithm = "dion3"
    _name = "Dion3"

    def __init__(self, params, distributed_mesh, defaults: Dict[str, Any], on_nonfinite: str,
                 workspace_limit: Optional[int] = None, megabatch: bool = True):
        _dist.check_mesh(distributed_mesh, self._name)
        self._mesh = distributed_mesh
        if on_nonfinite not in ("raise", "skip"):
            raise ValueError(f"dion3: 'on_nonfinite' must be 'raise' or 'skip'; got {on_nonfinite!r}")
        if defaults.get("newton_schulz_func") is not None:
            raise NotImplementedError(
                "dion3: newton_schulz_func is not supported (the orthogonalization runs in the C++ "
                "engine); choose orthogonalizer='auto'|'standard'|'gram' and, for other quintic "
                "steps, coefficients=[(a, b, c), ...]")
        if defaults.get("selection_scope", "local") not in ("local", "global"):
            raise ValueError(
                f"dion3: 'selection_scope' must be 'local' or 'global'; got {defaults['selection_scope']!r}")
        if workspace_limit is not None and (not isinstance(workspace_limit, int) or workspace_limit < 0):
            raise ValueError(f"dion3: 'workspace_limit' must be a byte count >= 0 or None; got {workspace_limit!r}")
        self._on_nonfinite = on_nonfinite
        self._workspace_limit = -1 if workspace_limit is None else workspace_limit
        self._megabatch = bool(megabatch)
        self._engine = None
        self._engine_key = None
        self._engine_params: List[torch.Tensor] = []
        self._engine_states: List[Dict[str, Any]] = []
        self._engine_cuda = False
        self._applied_seen = self._skipped_seen = 0  # engine counters already folded into state
        self._counters_pending = False
        self._engine_groups: List[int] = []
        self._steps_skipped = 0
        self._dirty = True
        self._dtensors = False  # the engine's parameters include DTensor shards
        self._unregistered: List[torch.Tensor] = []  # parameters without a gradient at the last rebuild
        super().__init__(params, defaults)

    # ---- torch.optim.Optimizer protocol ---------------------------------------------------

    def __setstate__(self, state: Dict[str, Any]) -> None:
        # Unpickling / deepcopy keep only defaults, state and param_groups (torch's __getstate__):
        # the engine is rebuilt at the next step.
        # torch's load_state_dict also comes through here, with only state and param_groups: keep
        # this optimizer's own settings then.
        on_nonfinite = state.get("_on_nonfinite", getattr(self, "_on_nonfinite", "raise"))
        workspace_limit = state.get("_workspace_limit", getattr(self, "_workspace_limit", -1))
        mesh = state.get("_mesh", getattr(self, "_mesh", None))
        megabatch = state.get("_megabatch", getattr(self, "_megabatch", True))
        super().__setstate__(state)
        self._on_nonfinite = on_nonfinite
        self._workspace_limit = workspace_limit
        self._mesh = mesh
        self._megabatch = megabatch
        self._dtensors = False
        self._unregistered = []
        self._engine, self._engine_key, self._engine_params, self._engine_groups = None, None, [], []
        self._engine_states = []
        self._engine_cuda = False
        self._applied_seen = self._skipped_seen = 0
        self._counters_pending = False
        self._steps_skipped = getattr(self, "_steps_skipped", 0)
        self._dirty = True

    def __getstate__(self) -> Dict[str, Any]:
        state = super().__getstate__()
        state["_on_nonfinite"] = self._on_nonfinite
        state["_workspace_limit"] = self._workspace_limit
        state["_steps_skipped"] = self._steps_skipped
        state["_mesh"] = self._mesh
        state["_megabatch"] = self._megabatch
        return state

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)
        try:
            self._check_group(len(self.param_groups) - 1, self.param_groups[-1])
        except Exception:
            self.param_groups.pop()  # nothing half-added
            raise
        # State exists from construction (as the reference's): every rank holds the same state
        # keys whatever got a gradient, and torch.distributed.checkpoint finds nothing to create.
        group = self.param_groups[-1]
        for p in group["params"]:
            if not self.state.get(p):
                self.state[p] = self._zero_state(group, p)
        self._dirty = True

    def _zero_state(self, group: Dict[str, Any], p: torch.Tensor) -> Dict[str, Any]:
        st: Dict[str, Any] = {}
        for name, dtype, shape in _state_shapes(group, p):
            t = _dist.zeros_like_layout(p, shape, dtype)
            t._dion3_initial = True  # made here, not given: may be remade if the group's settings change
            st[name] = t
        st["step"] = 0
        return st

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        # torch casts floating state to each parameter's dtype; dion3 keeps fp32 variance (and an
        # optional fp32 momentum) next to low-precision weights, so restore the saved dtypes.
        saved_groups = state_dict["param_groups"]
        super().load_state_dict(state_dict)
        ids = {}
        for g_saved, g in zip(saved_groups, self.param_groups):
            for pid, p in zip(g_saved["params"], g["params"]):
                ids[pid] = p
        for pid, st in state_dict["state"].items():
            p = ids.get(pid)
            if p is None:
                continue
            mine = self.state[p]
            for key, value in st.items():
                if not isinstance(value, torch.Tensor):
                    continue
                if _dist.is_dtensor(p) and not _dist.is_dtensor(value):
                    # A single-device (full) checkpoint loaded into a sharded run: keep this rank's part.
                    mine[key] = _dist.local_part(value.to(dtype=value.dtype), p)
                elif _dist.is_dtensor(value) and not _dist.is_dtensor(p):
                    mine[key] = value.full_tensor().detach().to(device=p.device, dtype=value.dtype, copy=True)
                elif _dist.is_dtensor(value):
                    mine[key] = value.detach().to(dtype=value.dtype, copy=True)
                else:
                    mine[key] = value.detach().to(device=p.device, dtype=value.dtype, copy=True)
        for i, g in enumerate(self.param_groups):
            for k, v in self.defaults.items():  # groups saved by an older version may lack new keys
                g.setdefault(k, v)
            self._check_group(i, g)
        self._dirty = True

    # Dynamo does not trace into the step (the engine is an opaque C++ call): a compiled training
    # function that calls opt.step() gets a clean graph break instead of a warning.
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        key = tuple((id(g), len(g["params"])) + _structure_key(g) for g in self.param_groups)
        if self._dirty or key != self._engine_key:
            self._rebuild(key)
        engine = self._engine
        if engine is None:  # no parameter had a gradient: look again (rare, so done in Python)
            if not any(p.grad is not None for g in self.param_groups for p in g["params"]):
                return loss
            self._rebuild(key)
            engine = self._engine
        for i, gi in enumerate(self._engine_groups):
            engine.update_group(i, _engine_config(self.param_groups[gi]))
        if self._engine_cuda and torch.cuda.is_current_stream_capturing():
            # CUDA-graph capture: the engine's capture-safe step (no host synchronisation). Step
            # counters then advance on the device only; _sync_counters() brings them back.
            if self._run_engine(engine, True) < 0:
                raise RuntimeError("dion3: the parameters with gradients (or their storage) changed "
                                   "since the last step; run one eager step before capturing")
            self._counters_pending = True
            return loss
        # The engine reads each parameter's .grad itself (no per-parameter Python work per step).
        status = self._run_engine(engine, False)
        if status < 0:  # the set of parameters with gradients changed, or a weight moved (p.data = ...)
            self._rebuild(key)
            engine = self._engine
            if engine is None:
                return loss
            for i, gi in enumerate(self._engine_groups):
                engine.update_group(i, _engine_config(self.param_groups[gi]))
            status = self._run_engine(engine, False)
            if status < 0:
                raise RuntimeError("dion3: internal error: the engine still asks for a rebuild")
        if status > 0:
            for st in self._engine_states:
                st["step"] += 1
            self._applied_seen += 1
        else:
            self._steps_skipped += 1
            self._skipped_seen += 1
        return loss

    def _run_engine(self, engine, asynchronous: bool) -> int:
        """The engine's step; -1 asks for a rebuild (the set of parameters with gradients changed)."""
        if self._dtensors:
            # DTensor gradients live on the DTensor, not on the local shard the engine holds: hand
            # the engine this step's local gradients.
            if any(p.grad is not None for p in self._unregistered):
                return -1
            grads = [_dist.local(p.grad) for p in self._engine_params]
            if any(g is None for g in grads):
                return -1
            return engine.step_async_with(grads) if asynchronous else engine.step_with(grads)
        return engine.step_async() if asynchronous else engine.step()

    def _sync_counters(self) -> None:
        """Fold the steps the engine applied or dropped without us seeing them (replays of a
        captured CUDA graph) into state[p]["step"] and steps_skipped. Synchronises the device."""
        if not self._counters_pending or self._engine is None:
            return
        applied, skipped = self._engine.steps_taken, self._engine.steps_skipped
        for st in self._engine_states:
            st["step"] += applied - self._applied_seen
        self._steps_skipped += skipped - self._skipped_seen
        self._applied_seen, self._skipped_seen = applied, skipped
        self._counters_pending = False

    def state_dict(self) -> Dict[str, Any]:
        self._sync_counters()
        return super().state_dict()

    # ---- introspection ---------------------------------------------------------------------

    @property
    def steps_skipped(self) -> int:
        """Steps dropped because a gradient was not finite (on_nonfinite='skip', or any dropped
        step of a captured CUDA graph)."""
        self._sync_counters()
        return self._steps_skipped

    def sync_counters(self) -> None:
        """After replaying a captured step, bring state[p]["step"] up to date (state_dict() and
        steps_skipped do this themselves)."""
        self._sync_counters()

    def plan(self) -> List[Dict[str, Any]]:
        """The engine's megabatches (shape, count, selected rows, orthogonalizer, workspace)."""
        return [] if self._engine is None else self._engine.plan()

    # ---- internals --------------------------------------------------------------------------

    def _param_name(self, group: Dict[str, Any], gi: int, j: int) -> str:
        names = group.get("param_names")
        if names is not None and j < len(names):
            return str(names[j])
        return f"group{gi}.param{j}"

    def _check_group(self, gi: int, group: Dict[str, Any]) -> None:
        """Everything that can be told before a step, so errors come before any change."""
        try:
            cfg = _engine_config(group)
            _C.validate_group(cfg)
        except ValueError as e:
            msg = str(e)
            if msg.startswith("dion3: "):
                msg = msg[len("dion3: "):]
            raise ValueError(f"dion3: parameter group {gi}: {msg}") from None
        matrix = group["algorithm"] in MATRIX_ALGORITHMS
        device = None
        for j, p in enumerate(group["params"]):
            who = f"parameter {j} '{self._param_name(group, gi, j)}' of group {gi}"
            if p.dtype not in _SUPPORTED_DTYPES:
                raise ValueError(f"dion3: {who} has dtype {_dtype_name(p.dtype)} but dion3 supports "
                                 "float32, float16 and bfloat16")
            if device is None:
                device = p.device
            elif p.device != device:
                raise ValueError(f"dion3: {who} is on {p.device} but the group's first parameter is on "
                                 f"{device}; one optimizer steps parameters of one device")
            if not p.is_contiguous():
                raise ValueError(f"dion3: {who} is not contiguous; dion3 needs contiguous parameters")
            if matrix and p.dim() < 2:
                algo = {"muon": "Muon", "normuon": "NorMuon"}.get(group["algorithm"], "Dion3")
                raise ValueError(f"dion3: {who} has shape {list(p.shape)} but {algo} needs a matrix; put "
                                 "1-D tensors in an 'adamw' or 'lion' group")
        # Layouts: every rank sees the same metadata, so every rank raises alike, before any step.
        meshes = []
        for j, p in enumerate(group["params"]):
            who = f"parameter {j} '{self._param_name(group, gi, j)}' of group {gi}"
            _dist.layout_of(p, self._mesh, who, matrix, bool(group["flatten"]))
            if _dist.is_dtensor(p) and not any(_dist.same_mesh(p.device_mesh, m) for m in meshes):
                meshes.append(p.device_mesh)
        if len(meshes) > 1:
            raise ValueError(f"dion3: parameter group {gi} holds parameters on {len(meshes)} different device "
                             f"meshes ({', '.join(str(m) for m in meshes)}); put each mesh's parameters in a "
                             "group (or an optimizer) of their own")
        # Across groups: one device per optimizer (one engine, so nothing is ever half-stepped).
        first = next((p for g in self.param_groups for p in g["params"]), None)
        if first is not None and device is not None and device != first.device:
            raise ValueError(f"dion3: parameter group {gi} is on {device} but group 0 is on "
                             f"{first.device}; one optimizer steps parameters of one device "
                             "(create one optimizer per device)")

    def _rebuild(self, key) -> None:
        """Register the parameters that have a gradient with a fresh engine."""
        self._sync_counters()
        self._engine = None
        self._engine_key = None
        params_with_grad = []
        for gi, group in enumerate(self.param_groups):
            self._check_group(gi, group)
            members = [(j, p) for j, p in enumerate(group["params"]) if p.grad is not None]
            if members:
                params_with_grad.append((gi, group, members))
        if not params_with_grad:
            self._engine_key = key
            self._dirty = False
            return
        device = params_with_grad[0][2][0][1].device
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"dion3: parameters are on '{device}'; dion3 runs on cpu and cuda")
        engine = _C.Engine(device.type, device.index or 0, self._on_nonfinite, self._workspace_limit,
                           getattr(self, "_megabatch", True))
        new_state: Dict[torch.Tensor, Dict[str, Any]] = {}
        engine_params, engine_groups, steps, adamw_check = [], [], [], []
        dtensors = False
        for gi, group, members in params_with_grad:
            ei = engine.add_group(_engine_config(group))
            engine_groups.append(gi)
            matrix = group["algorithm"] in MATRIX_ALGORITHMS
            for j, p in members:
                name_j = self._param_name(group, gi, j)
                old = self.state.get(p, {})
                st = {}
                for name, dtype, shape in _state_shapes(group, p):
                    t = old.get(name)
                    # Zero state made at construction for settings (momentum_dtype, flatten, the
                    # algorithm) changed before the parameter's first step is made again.
                    if t is None or (getattr(t, "_dion3_initial", False) and not old.get("step", 0) and
                                     (t.dtype != dtype or tuple(t.shape) != tuple(shape))):
                        t = _dist.zeros_like_layout(p, shape, dtype)
                    st[name] = t
                if p.grad.device != p.device:
                    raise ValueError(f"dion3: parameter '{name_j}' is on "
                                     f"{p.device} but its gradient is on {p.grad.device}")
                layout = _dist.layout_of(p, self._mesh, f"parameter '{name_j}'", matrix, bool(group["flatten"]))
                is_dt = _dist.is_dtensor(p)
                dtensors |= is_dt
                engine.add_param(ei, name_j, _dist.local(p), {k: _dist.local(t) for k, t in st.items()},
                                 layout.kind, layout.group, layout.global_rows, layout.global_cols,
                                 layout.row_offset, layout.row_chunk, layout.col_group,
                                 _dist.local(p.grad) if is_dt else None)
                st["step"] = int(old.get("step", 0))
                new_state[p] = st
                engine_params.append(p)
                steps.append(st["step"])
                adamw_check.append((group, p))
        unregistered = [p for g in self.param_groups for p in g["params"] if p.grad is None]
        engine.watch([p for p in unregistered if not _dist.is_dtensor(p)])
        # Only AdamW's bias correction reads the engine's per-parameter counters; restoring them
        # costs a host round trip of the state (the engine has no cheaper setter yet), so it is
        # done only when an AdamW parameter resumes.
        applied_seen, skipped_seen = 0, 0
        if any(s and g["algorithm"] == "adamw" for s, (g, _) in zip(steps, adamw_check)):
            engine.set_param_steps(steps, max(steps), self._steps_skipped)
            applied_seen, skipped_seen = max(steps), self._steps_skipped
        # The engine accepted everything: commit the state.
        for p, st in new_state.items():
            self.state[p].update(st)
        self._engine = engine
        self._engine_params = engine_params
        self._engine_cuda = device.type == "cuda"
        self._applied_seen, self._skipped_seen = applied_seen, skipped_seen
        self._counters_pending = False
        self._engine_states = [self.state[p] for p in engine_params]
        self._engine_groups = engine_groups
        self._engine_key = key
        self._dtensors = dtensors
        self._unregistered = unregistered if dtensors else []
        self._dirty = False


def _defaults(**kw) -> Dict[str, Any]:
    return kw  # validated per group in _check_group, with the group's index in the message


class Dion3(_EngineOptimizer):
    """Dion3: Muon that orthogonalizes only a fraction of the momentum rows each step, with error
    feedback and NorMuon normalization (SPEC.md §1). Same constructor as the reference
    `dion.Dion3`; extra, explicit arguments: orthogonalizer ('auto'|'standard'|'gram', onto which
    use_gram_newton_schulz maps), scale_lr_by_fraction, on_nonfinite ('raise'|'skip'),
    workspace_limit (bytes of orthogonalization workspace; None = the engine's default),
    megabatch (False: one collective round per matrix instead of per shape group, for benchmarks),
    momentum_dtype, iteration_dtype, coefficients and restarts.
    use_triton is accepted and ignored (the engine has its own kernels)."""

    _default_algorithm = "dion3"
    _name = "Dion3"

    def __init__(self, params, distributed_mesh=None, lr: float = 0.01, fraction: float = 0.25,
                 mu: float = 0.95, muon_beta2: float = 0.95, betas: Tuple[float, float] = (0.9, 0.95),
                 weight_decay: float = 0.01, epsilon: float = 1e-8, adjust_lr: Optional[str] = "spectral_norm",
                 flatten: bool = False, use_triton: bool = False, use_polar_express: bool = True,
                 use_gram_newton_schulz: bool = False, newton_schulz_func=None,
                 selection_scope: str = "local", *, orthogonalizer: str = "auto",
                 scale_lr_by_fraction: bool = False, on_nonfinite: str = "raise",
                 workspace_limit: Optional[int] = None,
                 momentum_dtype: Optional[torch.dtype] = None, iteration_dtype: Optional[torch.dtype] = None,
                 coefficients: Optional[Sequence[Tuple[float, float, float]]] = None,
                 restarts: Optional[Sequence[int]] = None, cautious_wd: bool = False, nesterov: bool = False,
                 megabatch: bool = True):
        defaults = _defaults(
            algorithm=self._default_algorithm, lr=lr, fraction=fraction, mu=mu, muon_beta2=muon_beta2,
            betas=tuple(betas), weight_decay=weight_decay, epsilon=epsilon, adjust_lr=adjust_lr,
            flatten=flatten, use_triton=use_triton, use_polar_express=use_polar_express,
            use_gram_newton_schulz=use_gram_newton_schulz, newton_schulz_func=newton_schulz_func,
            selection_scope=selection_scope, orthogonalizer=orthogonalizer,
            scale_lr_by_fraction=scale_lr_by_fraction, momentum_dtype=momentum_dtype,
            iteration_dtype=iteration_dtype, coefficients=coefficients, restarts=restarts,
            cautious_wd=cautious_wd, nesterov=nesterov)
        super().__init__(params, distributed_mesh, defaults, on_nonfinite, workspace_limit, megabatch)


class NorMuon(_EngineOptimizer):
    """NorMuon: Muon with per-row second-moment normalization (SPEC.md §1 baselines). Same
    constructor as the reference `dion.NorMuon`, plus Dion3's explicit extra arguments."""

    _default_algorithm = "normuon"
    _name = "NorMuon"

    def __init__(self, params, distributed_mesh=None, lr: float = 0.01, mu: float = 0.95,
                 muon_beta2: float = 0.95, betas: Tuple[float, float] = (0.9, 0.95), weight_decay: float = 0.01,
                 cautious_wd: bool = False, epsilon: float = 1e-8, nesterov: bool = False,
                 adjust_lr: Optional[str] = "spectral_norm", flatten: bool = False,
                 use_gram_newton_schulz: bool = False, use_triton: bool = False, use_polar_express: bool = True,
                 newton_schulz_func=None, *, orthogonalizer: str = "auto", on_nonfinite: str = "raise",
                 workspace_limit: Optional[int] = None,
                 momentum_dtype: Optional[torch.dtype] = None, iteration_dtype: Optional[torch.dtype] = None,
                 coefficients: Optional[Sequence[Tuple[float, float, float]]] = None,
                 restarts: Optional[Sequence[int]] = None, fraction: float = 0.25,
                 scale_lr_by_fraction: bool = False, megabatch: bool = True):
        defaults = _defaults(
            algorithm=self._default_algorithm, lr=lr, fraction=fraction, mu=mu, muon_beta2=muon_beta2,
            betas=tuple(betas), weight_decay=weight_decay, epsilon=epsilon, adjust_lr=adjust_lr,
            flatten=flatten, use_triton=use_triton, use_polar_express=use_polar_express,
            use_gram_newton_schulz=use_gram_newton_schulz, newton_schulz_func=newton_schulz_func,
            selection_scope="local", orthogonalizer=orthogonalizer,
            scale_lr_by_fraction=scale_lr_by_fraction, momentum_dtype=momentum_dtype,
            iteration_dtype=iteration_dtype, coefficients=coefficients, restarts=restarts,
            cautious_wd=cautious_wd, nesterov=nesterov)
        super().__init__(params, distributed_mesh, defaults, on_nonfinite, workspace_limit, megabatch)


class Muon(_EngineOptimizer):
    """Muon: the orthogonalized momentum update (SPEC.md §1 baselines). Same constructor as the
    reference `dion.Muon`, plus Dion3's explicit extra arguments."""

    _default_algorithm = "muon"
    _name = "Muon"

    def __init__(self, params, distributed_mesh=None, lr: float = 0.01, mu: float = 0.95,
                 betas: Tuple[float, float] = (0.9, 0.95), weight_decay: float = 0.01, cautious_wd: bool = False,
                 epsilon: float = 1e-8, nesterov: bool = False, adjust_lr: Optional[str] = "spectral_norm",
                 flatten: bool = False, use_gram_newton_schulz: bool = False, use_triton: bool = False,
                 use_polar_express: bool = True, newton_schulz_func=None, *, orthogonalizer: str = "auto",
                 on_nonfinite: str = "raise", workspace_limit: Optional[int] = None, momentum_dtype: Optional[torch.dtype] = None,
                 iteration_dtype: Optional[torch.dtype] = None,
                 coefficients: Optional[Sequence[Tuple[float, float, float]]] = None,
                 restarts: Optional[Sequence[int]] = None, muon_beta2: float = 0.95, fraction: float = 0.25,
                 scale_lr_by_fraction: bool = False, megabatch: bool = True):
        defaults = _defaults(
            algorithm=self._default_algorithm, lr=lr, fraction=fraction, mu=mu, muon_beta2=muon_beta2,
            betas=tuple(betas), weight_decay=weight_decay, epsilon=epsilon, adjust_lr=adjust_lr,
            flatten=flatten, use_triton=use_triton, use_polar_express=use_polar_express,
            use_gram_newton_schulz=use_gram_newton_schulz, newton_schulz_func=newton_schulz_func,
            selection_scope="local", orthogonalizer=orthogonalizer,
            scale_lr_by_fraction=scale_lr_by_fraction, momentum_dtype=momentum_dtype,
            iteration_dtype=iteration_dtype, coefficients=coefficients, restarts=restarts,
            cautious_wd=cautious_wd, nesterov=nesterov)
        super().__init__(params, distributed_mesh, defaults, on_nonfinite, workspace_limit, megabatch)
