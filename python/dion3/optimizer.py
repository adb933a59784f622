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

import atexit
import bisect
import collections
import copy
import functools
import gc
import math
import numbers
import re
import threading
import warnings
import weakref
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as _torch_dist

from . import _C
from . import distributed as _dist

NonFiniteError = _C.NonFiniteError


class _StateMap(collections.defaultdict):
    """optimizer.state, counting the changes of which dict a parameter maps to (assignments,
    deletions, clear), so that a step notices a replaced state at the cost of one comparison; the
    tensors inside a parameter's dict are watched by the engine. Reading the state of a parameter
    that has none (the empty dict defaultdict inserts) changes nothing registered: not counted."""

    def __init__(self, default_factory=dict, *args, **kwargs):
        self.version = 0
        super().__init__(default_factory, *args, **kwargs)

    def _changed(self) -> None:
        self.version += 1

    def __missing__(self, key):
        value = self.default_factory()
        dict.__setitem__(self, key, value)
        return value

    def __setitem__(self, key, value):
        self._changed()
        super().__setitem__(key, value)

    def __delitem__(self, key):
        self._changed()
        super().__delitem__(key)

    def clear(self):
        self._changed()
        super().clear()

    def pop(self, *args):
        self._changed()
        return super().pop(*args)

    def popitem(self):
        self._changed()
        return super().popitem()

    def setdefault(self, key, default=None):
        if key not in self:
            self._changed()
        return super().setdefault(key, default)

    def update(self, *args, **kwargs):
        self._changed()
        super().update(*args, **kwargs)

    def __ior__(self, other):
        self._changed()
        return super().__ior__(other)


class CaptureNotReady(RuntimeError):
    """step() under CUDA-graph capture met parameters that the engine has not stepped eagerly yet
    (their gradients, or their storage, changed): nothing was enqueued."""

MATRIX_ALGORITHMS = ("dion3", "nordion2", "dion2", "normuon", "muon")

# Group keys that torch's learning-rate schedulers and SWA write into param groups: carried, unread.
_SCHEDULER_KEYS = frozenset({"initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum", "swa_lr"})
# A setting's name with one of these around it is a record or tag of that setting (a scheduler's
# initial_weight_decay, a per-group weight_decay_mult), carried untouched: not a typo of it.
_TAG_PREFIXES = ("initial_",)
_TAG_SUFFIXES = ("_mult", "_multiplier", "_scale")


def _one_edit_apart(a: str, b: str) -> bool:
    """Whether a becomes b by one letter inserted, deleted, replaced, or two neighbours swapped:
    a typo. Keys further away (no_weight_decay, a user's own tag) are not taken for one."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if len(a) == len(b):
        return a[i + 1:] == b[i + 1:] or (a[i + 2:] == b[i + 2:] and a[i:i + 2] == b[i:i + 2][::-1])
    return (a[i + 1:] == b[i:]) if len(a) > len(b) else (a[i:] == b[i + 1:])


def _is_setting_tag(key: str, known) -> bool:
    return any(key.startswith(p) and key[len(p):] in known for p in _TAG_PREFIXES) or \
        any(key.endswith(x) and key[:-len(x)] in known for x in _TAG_SUFFIXES)


# Other optimizers' names for settings dion3 has under another name.
# {other name: dion3's names for it}; the first that the optimizer knows is the one it names.
_KEY_ALIASES = {"eps": ("epsilon",), "momentum": ("mu", "ef_decay"), "beta2": ("muon_beta2",),
                "rank_fraction": ("fraction",), "nesterov_momentum": ("nesterov",),
                "adjust_learning_rate": ("adjust_lr",), "adjust_lr_fn": ("adjust_lr",),
                "ns_coefficients": ("coefficients",), "ns_steps": ("coefficients",),
                # the error-feedback decay: Dion2's name in a Dion3 optimizer, Dion3's in a Dion2 one
                "ef_decay": ("mu",), "mu": ("ef_decay",)}
# torch.optim options that change the result and that dion3 does not implement: refused when
# set, never ignored. {key: what to do instead}
_UNIMPLEMENTED_TORCH_OPTIONS = {"maximize": "minimize the negated objective instead",
                                "amsgrad": "dion3's AdamW keeps no running maximum of its second moment"}
_NO_NS_FUNC = ("newton_schulz_func is not supported (the orthogonalization runs in the C++ engine); choose "
               "orthogonalizer='auto'|'standard'|'gram' and, for other quintic steps, coefficients=[(a, b, c), ...]")
ELEMENTWISE_ALGORITHMS = ("adamw", "lion")
ALGORITHMS = MATRIX_ALGORITHMS + ELEMENTWISE_ALGORITHMS
_ORTHOGONALIZERS = ("auto", "standard", "gram")
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Quintic Newton–Schulz coefficient sets by name (group key "coefficients", dion3.orthogonalize),
# the engine's own tables (algorithm.md §2): Polar Express (the default; use_polar_express=False gives
# the "you" set of five tuned steps) and "reference", the reference package's default set.
COEFFICIENT_SETS = _C.coefficient_sets()
# The engine's defaults of the group settings: the constructors' signatures repeat them for
# help() and introspection (tests/python/test_api.py checks that the two agree).
ENGINE_DEFAULTS = _C.group_defaults()
POLAR_EXPRESS, YOU, REFERENCE = (COEFFICIENT_SETS[k] for k in ("polar_express", "you", "reference"))


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
        polar_express = _flag(group, "use_polar_express") if "use_polar_express" in group else True
        coefficients = POLAR_EXPRESS if polar_express else YOU
    elif isinstance(coefficients, str):
        if coefficients not in COEFFICIENT_SETS:
            raise ValueError(f"dion3: 'coefficients' names one of {', '.join(COEFFICIENT_SETS)} or is a list of "
                             f"(a, b, c) steps; got {coefficients!r}")
        coefficients = COEFFICIENT_SETS[coefficients]
    restarts = group.get("restarts")
    if restarts is None:
        # The default restart positions that a short list of steps never reaches are dropped.
        restarts = [r for r in ENGINE_DEFAULTS["restarts"] if r < len(coefficients)]
    elif isinstance(restarts, (str, bytes)) or not hasattr(restarts, "__iter__"):
        raise ValueError(f"dion3: 'restarts' must be a list of step positions (e.g. [2]); got {restarts!r}")
    betas = group["betas"]
    if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
        raise ValueError(f"dion3: 'betas' must be a pair (beta1, beta2); got {betas!r}")
    adjust_lr = group["adjust_lr"]
    cfg = {
        "algorithm": algorithm,
        "lr": _number("lr", group["lr"]),
        "fraction": _number("fraction", group["fraction"]),
        "mu": _number("ef_decay", group["ef_decay"]) if "ef_decay" in group else _number("mu", group["mu"]),
        "muon_beta2": _number("muon_beta2", group["muon_beta2"]),
        "beta1": _number("betas", betas[0]),
        "beta2": _number("betas", betas[1]),
        "weight_decay": _number("weight_decay", group["weight_decay"]),
        "epsilon": _number("epsilon", group["epsilon"]),
        "adjust_lr": "none" if adjust_lr is None else str(adjust_lr),
        "flatten": _flag(group, "flatten"),
        "nesterov": _flag(group, "nesterov"),
        # The constructor's value reaches every group: the element-wise ones ignore it, as they do
        # nesterov; a Dion3 or Dion2 group is refused by the engine (the form is Muon's and NorMuon's).
        "ema_momentum": "ema_momentum" in group and _flag(group, "ema_momentum") and algorithm not in
        ("adamw", "lion"),
        "cautious_wd": _flag(group, "cautious_wd"),
        "scale_lr_by_fraction": _flag(group, "scale_lr_by_fraction"),
        "momentum_dtype": _dtype_name(group.get("momentum_dtype")),
        "orthogonalizer": orth,
        "coefficients": [tuple(_number("coefficients", x) for x in step) for step in coefficients],
        "restarts": [_integer("restarts", r) for r in restarts],
        "iteration_dtype": _dtype_name(group.get("iteration_dtype")),
        # algorithm.md §2's X / (norm + eps); dion3.optim.Muon asks for torch's X / max(norm, eps).
        "norm_eps": _number("norm_eps", group["norm_eps"]) if "norm_eps" in group else 1e-7,
        "norm_floor": _flag(group, "norm_floor") if "norm_floor" in group else False,
        "selection_scope": str(group.get("selection_scope", "local")),
        "split_sizes": _split_sizes(group.get("split_sizes")),
        "num_heads": _num_heads(group.get("num_heads")),
        "transposed": _transposed(group),
    }
    return cfg


class _ReadKeys(dict):
    """A copy of a group that notes the keys _engine_config reads."""

    def __init__(self, group: Dict[str, Any]):
        super().__init__(group)
        self.read: List[str] = []

    def __getitem__(self, key):
        self.read.append(key)
        return dict.__getitem__(self, key)

    def get(self, key, default=None):
        self.read.append(key)
        return dict.get(self, key, default)

    def __contains__(self, key):
        self.read.append(key)
        return dict.__contains__(self, key)


# Group keys that schedulers move every step and that the engine's config holds under the same
# name, as plain numbers (dion3.optim.Muon's groups too): a change of these alone is pushed
# without building the config anew.
_SCHEDULED_KEYS = frozenset({"lr", "weight_decay"})

# Values that cannot change in place, so equal snapshots mean equal settings.
_PLAIN = (bool, int, float, str, type(None), torch.dtype)


def _plain_snapshot(group: Dict[str, Any], keys: Tuple[str, ...]) -> Optional[Tuple]:
    """The group's values of `keys`, or None if one of them could change in place (a list, a
    tensor lr, ...): such a group is pushed to the engine before every step."""
    values = []
    for k in keys:
        v = group.get(k)
        items = v if type(v) is tuple else (v,)
        if not all(type(x) in _PLAIN for x in items):
            return None
        # With the types: 5.0 == 5 == True, but the engine may accept one and refuse another.
        values.append((tuple(map(type, items)), v))
    return tuple(values)


def _is_bool(v) -> bool:
    """Python's bool or numpy's (numpy.bool in numpy 2, numpy.bool_ in numpy 1)."""
    return isinstance(v, bool) or type(v).__module__ == "numpy" and type(v).__name__ in ("bool", "bool_")


def _real(v) -> bool:
    """A plain real number (not a bool)."""
    return isinstance(v, numbers.Real) and not _is_bool(v)


def _flag(group: Dict[str, Any], key: str) -> bool:
    """A group's on/off setting: True or False (numpy's bools and the ints 0 and 1 too), so that a
    string such as "False" is refused rather than read as true."""
    v = group[key]
    if _is_bool(v) or isinstance(v, numbers.Integral) and v in (0, 1):
        return bool(v)
    raise ValueError(f"dion3: '{key}' must be True or False; got {v!r}")


def _without_empty_entries(state_dict: Any) -> Any:
    """state_dict without the parameter entries that hold nothing: None, empty (reading opt.state[p] of a
    parameter without state makes one), or torch.distributed.checkpoint's placeholders ({}) for
    state it did not find. Such a parameter is one without saved state (see _load_plan)."""
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict):
        return state_dict
    state = {k: st for k, st in state_dict["state"].items()
             if st is not None and
             not (isinstance(st, dict) and all(isinstance(v, dict) and not v for v in st.values()))}
    return state_dict if len(state) == len(state_dict["state"]) else dict(state_dict, state=state)


def _number(key: str, v) -> float:
    """A real-valued setting; a string (a config file's "1e-3") is refused, not parsed: torch's
    schedulers would later fail on it far from the cause. A bool is refused too."""
    if isinstance(v, (str, bytes)):
        raise ValueError(f"dion3: '{key}' must be a number; got the string {v!r}")
    if _is_bool(v):  # float(True) is 1: fraction=True would select every row without a word
        raise ValueError(f"dion3: '{key}' must be a number; got the bool {bool(v)}")
    # The common case outside the try: a signal handler's exception is then not taken for a bad value.
    if type(v) in (float, int):
        return float(v)
    if isinstance(v, torch.Tensor):
        v = v.detach()  # a schedule's tensor that requires grad: float() of it would warn
    try:
        return float(v)
    except (TypeError, ValueError, RuntimeError):  # None, a sequence, a tensor of several values
        raise ValueError(f"dion3: '{key}' must be a number; got {v!r}") from None


def _integer(key: str, v) -> int:
    """An integer setting, refusing 1.5 (which int() would cut to 1) and True."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise ValueError(f"dion3: '{key}' must hold integers; got {v!r}")
    return int(v)


def _split_sizes(value) -> List[int]:
    """A group's split_sizes as a list of ints ([] for None)."""
    if value is None:
        return []
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) and not isinstance(value, torch.Size):
        raise ValueError(f"dion3: 'split_sizes' must be a sequence of row counts, e.g. (q, kv, kv); got {value!r}")
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise ValueError(f"dion3: 'split_sizes' must hold integers; got {value!r}")
        if not 1 <= v < 2**63:  # the engine's sizes are 64-bit
            raise ValueError(f"dion3: 'split_sizes' must hold block sizes >= 1 and below 2**63 (64-bit), "
                             f"got {int(v)}")
        out.append(int(v))
    return out


def _num_heads(value) -> int:
    """A group's num_heads as an int (0 for None)."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= value < 2**63:
        raise ValueError(f"dion3: 'num_heads' must be a positive integer (64-bit) or None; got {value!r}")
    return int(value)


def _state_shapes(group: Dict[str, Any], p: torch.Tensor,
                  kind: str) -> Sequence[Tuple[str, torch.dtype, Tuple[int, ...]]]:
    """State tensors of p, named and shaped as the reference package's (checkpoints move both
    ways): the engine's list (_C.state_specs: which tensors, their dtypes and sizes) under the
    reference's names (or those of `kind`, an optimizer's own: _EngineOptimizer._state_kind), the
    per-row variance laid out as p[..., 0:1] (`variance_neuron`; p[..., 0:1, :] in a transposed
    group, one value per column)."""
    return _state_shapes_of(group["algorithm"], bool(group["flatten"]), _dtype_name(group.get("momentum_dtype")),
                            _dtype_name(p.dtype), tuple(p.shape), kind, _transposed(group))


def _transposed(group: Dict[str, Any]) -> bool:
    """Whether a group's matrices are stored (in, out) (absent: no)."""
    return _flag(group, "transposed") if "transposed" in group else False


@functools.lru_cache(maxsize=4096)  # asked for every parameter at every (re)registration
def _state_shapes_of(algorithm: Any, flatten: bool, momentum_dtype: Optional[str], dtype: str,
                     shape: Tuple[int, ...], kind: str,
                     transposed: bool = False) -> Tuple[Tuple[str, torch.dtype, Tuple[int, ...]], ...]:
    to_reference = {engine: name for name, engine in _ENGINE_NAMES[kind].items()}
    out = []
    for engine_name, state_dtype, state_shape in _C.state_specs(algorithm, flatten, momentum_dtype, dtype,
                                                                list(shape), transposed):
        if engine_name == "variance":
            # flatten=True takes a >= 3-D tensor as (dim0, rest): one row per output channel.
            if transposed and len(shape) >= 2:
                rows = tuple(shape[:-2]) + (1, shape[-1])
            else:
                rows = (shape[0], 1) if flatten and len(shape) > 2 else tuple(shape[:-1]) + (1,)
            if math.prod(rows) != math.prod(state_shape):
                raise RuntimeError(f"dion3: internal: variance of {shape} laid out as {rows}, "
                                   f"but the engine keeps {tuple(state_shape)}")
            state_shape = rows
        out.append((to_reference[engine_name], getattr(torch, state_dtype), tuple(state_shape)))
    return tuple(out)


# Keys torch.optim.Optimizer adds to an optimizer's defaults itself (not group settings of ours).
_TORCH_DEFAULT_KEYS = frozenset({"differentiable", "foreach", "fused", "capturable", "maximize"})
_FRESH: Dict[type, Dict[str, Any]] = {}


def _fresh_defaults(cls: type) -> Dict[str, Any]:
    """The defaults of a newly made `cls`, made once per class; {} for a subclass whose
    constructor needs more than a parameter list."""
    if cls not in _FRESH:
        try:
            _FRESH[cls] = dict(cls([torch.zeros(2, 2, dtype=torch.float32, requires_grad=True)]).defaults)
        except Exception:  # noqa: BLE001 - only a convenience for old pickles
            _FRESH[cls] = {}
    return _FRESH[cls]


# Optimizers that may hold an engine. Their engines (torch's CUDA memory, pinned tensors) are
# dropped when the interpreter starts to exit, while torch is still whole, rather than whenever
# the interpreter's teardown happens to free them. An engine left in a reference cycle needs the
# collection.
_LIVE: "weakref.WeakSet[_EngineOptimizer]" = weakref.WeakSet()


def _name_groups(groups) -> Dict[str, int]:
    """Each parameter name the groups give (param_names) -> the index of its group."""
    return {str(n): gi for gi, g in enumerate(groups) if isinstance(g, dict) and isinstance(g.get("param_names"), list)
            for n in g["param_names"]}


def _regrouped(saved_groups, groups) -> str:
    """For a refused load whose groups differ from the optimizer's: where named parameters sit in
    each (a few), and what to do."""
    there, here = _name_groups(saved_groups), _name_groups(groups)
    moved = [f"'{n}' (group {there[n]} there, {here[n]} here)" for n in here if n in there and there[n] != here[n]]
    moved += [f"'{n}' (not in the state_dict)" for n in here if n not in there]
    moved += [f"'{n}' (not in this optimizer)" for n in there if n not in here]
    if not there or not here or not moved:
        return "; build the optimizer's groups as the checkpoint's were"
    shown = ", ".join(moved[:3]) + (f" and {len(moved) - 3} more" if len(moved) > 3 else "")
    return (f": {shown}. Build the groups as the checkpoint's were (dion3.param_groups of another version, or "
            "called with other arguments, may group them otherwise)")


def _refuse_misplaced_names(saved_groups, groups) -> None:
    """Where both sides name their parameters, a name the state_dict holds in another group than
    here is refused: a load matches state and settings by position, so two same-shape matrices in
    swapped groups (which pass every shape check) would take each other's; and after
    torch.distributed.checkpoint matched the state by name, a group's settings and names are those
    of its first parameter's saved group, or missing. Names that differ otherwise may be a prefix
    ("module."); a reordering within one group is _load_plan's."""
    there, here = _name_groups(saved_groups), _name_groups(groups)
    if any(n in there and there[n] != gi for n, gi in here.items()):
        raise ValueError("dion3: load_state_dict: the state_dict's parameter groups hold these parameters "
                         "otherwise than this optimizer's, so a parameter would take another one's state or "
                         "another group's settings" + _regrouped(saved_groups, groups))


@atexit.register
def _drop_engines_at_exit() -> None:
    for opt in list(_LIVE):
        opt._engine, opt._engine_key = None, None
        opt._pushed, opt._pushed_to = {}, None
    try:
        gc.collect()
    except KeyboardInterrupt:  # a second Ctrl-C while exiting: exit without the traceback
        pass


# The engine's names of the state tensors, by the group's kind of algorithm.
_ENGINE_NAMES = {"matrix": {"momentum": "momentum", "variance_neuron": "variance"},
                 "adamw": {"momentum": "exp_avg", "variance": "exp_avg_sq"},
                 "lion": {"momentum": "exp_avg"},
                 "torch_muon": {"momentum_buffer": "momentum"}}
# Names earlier dion3 versions saved (the engine's), accepted on load: {kind: {old name: name}}.
_OLD_NAMES = {kind: {engine: name for name, engine in names.items() if engine != name}
              for kind, names in _ENGINE_NAMES.items()}


def _kind(algorithm: str) -> str:
    return "matrix" if algorithm in MATRIX_ALGORITHMS else algorithm


# State tensors are never inference tensors, wherever the optimizer is built, stepped or loaded
# (under torch.inference_mode): the engine watches the state's version counters, which those lack.
_STATE_MADE = torch.inference_mode(False)


@_STATE_MADE
def _state_tensors(group: Dict[str, Any], p: torch.Tensor, old: Dict[str, Any], kind: str,
                   who: str = "a parameter") -> Dict[str, torch.Tensor]:
    """p's state tensors for its group (named as `kind`'s): those of `old` that fit, zeros for the rest.
    who: p as an error message names it."""
    st = {}
    for name, dtype, shape in _state_shapes(group, p, kind):
        t = old.get(name)
        # Zero state made at construction for settings (momentum_dtype, flatten, the algorithm)
        # changed before the parameter's first step, or for a parameter moved since (meta-device
        # initialisation, then to_empty), is made again.
        if t is None or (getattr(t, "_dion3_initial", False) and not old.get("step", 0) and
                         (t.dtype != dtype or tuple(t.shape) != tuple(shape) or t.device != p.device)):
            t = _dist.zeros_like_layout(p, shape, dtype, _single_dim(group, name))
        elif isinstance(t, torch.Tensor) and tuple(t.shape) == tuple(shape) and \
                (t.device != p.device or (t.dtype != dtype and (dtype == p.dtype or name not in _SECOND_MOMENTS))):
            # The parameter moved to another device or dtype after its state was made
            # (model.to(...)), or its group's momentum_dtype changed: state that follows them
            # follows, cast as load_state_dict casts it.
            cast = t.detach().to(device=p.device, dtype=dtype)
            _check_cast(t, cast, name, who)
            t = cast
        if isinstance(t, torch.Tensor) and tuple(t.shape) == tuple(shape) and not _dist.is_dtensor(t):
            # The engine steps a channels-last weight in memory order and its state alike: state
            # laid out otherwise (the weight converted since, one way or the other) follows it.
            fmt = _dist.state_format(p, shape)
            if not t.is_contiguous(memory_format=fmt) and (fmt != torch.contiguous_format or
                                                           _dist.memory_format(t) is not None):
                t = t.detach().contiguous(memory_format=fmt)
        st[name] = t
    return st


def _check_cast(before: torch.Tensor, after: torch.Tensor, name: str, who: str) -> None:
    """Refuses state that a cast to a narrower dtype took out of range (a model cast to half
    precision after steps): the engine would refuse it as non-finite, a cause the user never sees."""
    if after.dtype == before.dtype or torch.finfo(after.dtype).max >= torch.finfo(before.dtype).max:
        return
    b, a = _dist.local(before), _dist.local(after)
    lost = ~torch.isfinite(a)  # on the new device; `before` may be on the old one (model.to(device, dtype))
    if bool(lost.any()) and bool((lost.to(b.device) & torch.isfinite(b)).any()):
        raise ValueError(f"dion3: {who}: its state '{name}' ({before.dtype}) holds values beyond the range of "
                         f"{after.dtype}, the dtype it follows now (was the model cast after steps?); cast the "
                         "model back, or start the parameter's state afresh (del optimizer.state[p])")


def _check_restructured(group: Dict[str, Any], p: torch.Tensor, st: Dict[str, Any], who: str, kind: str) -> None:
    """Refuses state shaped for the other flatten or transposed than the group's (set after the
    parameter's state took values), naming the setting, or for another shape of the parameter
    (resized through .data since), by the names opt.state[p] shows."""
    def shape_with(key: str, value: bool, name: str):  # the state's shape were the group's `key` `value`
        return {n: s for n, _, s in _state_shapes(dict(group, **{key: value}), p, kind)}.get(name)

    settings = (("flatten", bool(group["flatten"]), p.dim() > 2),
                ("transposed", _transposed(group), p.dim() >= 2 and kind == "matrix"))
    for name, _, shape in _state_shapes(group, p, kind):
        t = st.get(name)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) == tuple(shape):
            continue
        for key, value, applies in settings:
            if applies and tuple(t.shape) == shape_with(key, not value, name):
                raise ValueError(f"dion3: {who}: its state '{name}' has shape {list(t.shape)}, where its group asks "
                                 f"for {list(shape)} ({key}={value}): a parameter's {key} cannot change once its "
                                 "state holds values (it stepped, or its state was loaded); set it back, or start its "
                                 "state afresh (del optimizer.state[p])")
        raise ValueError(f"dion3: {who}: its state '{name}' has shape {list(t.shape)} but the parameter, of shape "
                         f"{list(p.shape)}, needs {list(shape)} (was it resized since its state was made?); start "
                         "its state afresh (del optimizer.state[p]), or give it state of that shape")


def _engine_state(group: Dict[str, Any], st: Dict[str, Any], order: Optional[Tuple[int, ...]],
                  kind: str) -> Dict[str, torch.Tensor]:
    """This rank's state tensors of a parameter as the engine takes them (views, never copies:
    the engine updates them in place), in the weight's memory order where it is channels-last."""
    names = _ENGINE_NAMES[kind]
    out = {}
    for k, t in st.items():
        if k in names:
            local = _dist.local(t)
            if k == "variance_neuron":
                local = local.view(-1)
            elif order is not None:
                local = local.permute(order)
            out[names[k]] = local
    return out


# Group keys whose change alters the engine's registration (everything else is pushed per step).
def _structure_key(group: Dict[str, Any]) -> Tuple:
    return (group["algorithm"], bool(group["flatten"]), _dtype_name(group.get("momentum_dtype")), _transposed(group))


def _without_names_that_do_not_fit(state_dict: Any) -> Any:
    """The state_dict without the name lists of groups whose parameters they do not match in
    number: another model's (a distributed checkpoint's groups get their params rebuilt by name but
    keep their name lists). Torch's load then keeps the live names, as where none were saved."""
    groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if not isinstance(groups, list):
        return state_dict
    fit = [{k: v for k, v in g.items() if k != "param_names"}
           if isinstance(g, dict) and isinstance(g.get("param_names"), list)
           and isinstance(g.get("params"), (list, tuple)) and len(g["param_names"]) != len(g["params"]) else g
           for g in groups]
    return state_dict if all(a is b for a, b in zip(fit, groups)) else dict(state_dict, param_groups=fit)


def _saved_steps_skipped(state_dict: Any) -> Any:
    """The skipped-step counter a state_dict carries: its own key, or (through
    torch.distributed.checkpoint, which keeps only state and param_groups) its groups' copies."""
    if not isinstance(state_dict, dict):
        return None
    if "steps_skipped" in state_dict:
        return state_dict["steps_skipped"]
    groups = state_dict.get("param_groups")
    found = [g["steps_skipped"] for g in groups if isinstance(g, dict) and "steps_skipped" in g] \
        if isinstance(groups, list) else []
    return found[0] if found else None  # every group carries the same count


def _refuse_unimplemented(gi: int, group: Dict[str, Any]) -> None:
    """Refuses an option set in group gi that dion3 would otherwise ignore."""
    if group.get("newton_schulz_func") is not None:
        raise NotImplementedError(f"dion3: parameter group {gi}: {_NO_NS_FUNC}")
    for key, what in _UNIMPLEMENTED_TORCH_OPTIONS.items():
        if group.get(key):
            raise ValueError(f"dion3: parameter group {gi}: {key}=True is not implemented ({what})")


class _Replan(Exception):
    """Inside step(): the engine's registration is stale, plan anew (see _push_or_refuse)."""


def _under_state_lock(method):
    """The method holds the optimizer's _state_lock: from another thread it waits for a running
    step's body (and a step waits for it), so it neither reads nor writes state beneath the step."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._state_lock:
            return method(self, *args, **kwargs)
    return locked


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# How a step refused on every rank ends its message (as the engine's own refusals do).
_NOT_APPLIED = "the step was not applied on this rank or on any rank it shares a collective with"


# Running means of squares (NorMuon's row variance, AdamW's second moment): never negative.
_SECOND_MOMENTS = ("variance_neuron", "variance")
_PER_FEATURE = ("variance_neuron",)  # one value per output feature (row; a transposed group's column)


def _single_dim(group: Dict[str, Any], name: str) -> Optional[int]:
    """The dimension along which a state tensor holds a single value (distributed.zeros_like_layout)."""
    return (-2 if _transposed(group) else -1) if name in _PER_FEATURE else None
# The engine counts steps in int64 and adds one per step, unchecked: a count above 2**62 (no run's)
# is refused, so that no number of steps after a load can overflow it.
_MAX_STEP = 2**62


def _step_count(value: Any, who: str) -> int:
    """A saved step counter as an int; ValueError naming `who` when it is not a count the engine
    can go on from (not an integer, negative, or above 2**62)."""
    v = value
    if isinstance(v, torch.Tensor):
        v = v.item() if v.numel() == 1 and not v.is_complex() and v.dtype != torch.bool else None
    if isinstance(v, numbers.Real) and not isinstance(v, (bool, numbers.Integral)) and float(v).is_integer():
        v = int(v)
    if not isinstance(v, numbers.Integral) or isinstance(v, bool) or not 0 <= int(v) <= _MAX_STEP:
        raise ValueError(f"dion3: load_state_dict: {who} has step {value!r}; a step counter must be an "
                         f"integer in [0, 2**62]")
    return int(v)


def _bad_value(t: torch.Tensor, second_moment: bool) -> Optional[str]:
    """The first value of a state tensor no optimizer run produces (NaN or Inf; a negative second
    moment), described, or None. Such a value would poison every later step."""
    if t.numel() == 0:
        return None
    flat = t.detach().reshape(-1)
    bad = ~torch.isfinite(flat)
    if second_moment:
        bad |= flat < 0
    if not bool(bad.any()):
        return None
    i = int(bad.nonzero()[0, 0])
    v = float(flat[i])
    text = "NaN" if math.isnan(v) else ("+Inf" if v > 0 else "-Inf") if math.isinf(v) else repr(v)
    why = "a second moment cannot be negative" if math.isfinite(v) else "state values must be finite"
    return f"{text} at element {i}; {why}"


@_STATE_MADE
def _loaded_tensor(value: torch.Tensor, p: torch.Tensor, group: Dict[str, Any], name: str, shape: Tuple[int, ...],
                   dtype: torch.dtype) -> torch.Tensor:
    """A saved state tensor as p's state holds it: a copy in `dtype` on p's device, laid out as the
    engine steps it; this rank's part where p is sharded, the whole where only the saved one was."""
    fmt = _dist.state_format(p, shape)
    if _dist.is_dtensor(p) and not _dist.is_dtensor(value):
        # A single-device (full) checkpoint loaded into a sharded run: keep this rank's part.
        t = _dist.local_part(value, p, _single_dim(group, name))
        return t if t.dtype == dtype else t.to(dtype=dtype)
    if _dist.is_dtensor(value) and not _dist.is_dtensor(p):
        return value.full_tensor().detach().to(device=p.device, dtype=dtype, copy=True, memory_format=fmt)
    if _dist.is_dtensor(value):
        return value.detach().to(dtype=dtype, copy=True, memory_format=fmt)
    return value.detach().to(device=p.device, dtype=dtype, copy=True, memory_format=fmt)


def _without_loaded_tensors(state_dict: Dict[str, Any], groups: List[Dict[str, Any]],
                            loaded: Dict[torch.Tensor, Dict[str, Any]]) -> Dict[str, Any]:
    """The state_dict for torch's load_state_dict without the state tensors dion3 has read and
    checked already (load_state_dict puts them in after it): torch looks each tensor's parameter
    up among all the groups' parameters, a cost that grows with the square of their number."""
    ids = {pid: p for saved, mine in zip(state_dict["param_groups"], groups)
           for pid, p in zip(saved["params"], mine["params"])}
    state = {}
    for pid, st in state_dict["state"].items():
        done = loaded.get(ids.get(pid), {})
        state[pid] = {k: v for k, v in st.items() if k not in done} if isinstance(st, dict) else st
    return dict(state_dict, state=state)


class _EngineOptimizer(torch.optim.Optimizer):
    """Common machinery of Dion3, Dion2, NorMuon and Muon (not public)."""

    _default_algorithm = "dion3"
    _name = "Dion3"

    # A ProcessGroup given as distributed_mesh is held weakly, as the engine's communicators hold
    # it: one the user destroys is freed then, not at the interpreter's teardown (where a gloo
    # group can abort the process). A DeviceMesh holds its groups by name.
    @property
    def _mesh(self) -> Any:
        held = self.__dict__.get("_mesh_held")
        if isinstance(held, weakref.ref):
            held = held()
            if held is None:
                raise ValueError(f"dion3: the process group given to {self._name}(distributed_mesh=...) was "
                                   "destroyed (torch.distributed.destroy_process_group); make the optimizer anew "
                                   "on a live group")
        return held

    @_mesh.setter
    def _mesh(self, mesh: Any) -> None:
        self._mesh_held = weakref.ref(mesh) if isinstance(mesh, _torch_dist.ProcessGroup) else mesh

    def __init__(self, params, distributed_mesh, defaults: Dict[str, Any], on_nonfinite: str,
                 workspace_limit: Optional[int] = None, megabatch: bool = True, blocking: Optional[bool] = None):
        _dist.check_mesh(distributed_mesh, self._name)
        self._mesh = distributed_mesh
        if on_nonfinite not in ("raise", "skip"):
            raise ValueError(f"dion3: 'on_nonfinite' must be 'raise' or 'skip'; got {on_nonfinite!r}")
        if defaults.get("newton_schulz_func") is not None:
            raise NotImplementedError(f"dion3: {_NO_NS_FUNC}")
        if defaults.get("selection_scope", "local") not in ("local", "global"):
            raise ValueError(
                f"dion3: 'selection_scope' must be 'local' or 'global'; got {defaults['selection_scope']!r}")
        if workspace_limit is not None and (not isinstance(workspace_limit, int) or workspace_limit < 0):
            raise ValueError(f"dion3: 'workspace_limit' must be a byte count >= 0 or None; got {workspace_limit!r}")
        if blocking not in (None, True, False):
            raise ValueError(f"dion3: 'blocking' must be True, False or None; got {blocking!r}")
        if distributed_mesh is not None and on_nonfinite == "raise" and blocking is False:
            # Each rank would raise for a dropped step when its own copy of the verdict arrives:
            # at different steps, after which their collectives pair the wrong steps.
            raise ValueError("dion3: on_nonfinite='raise' with blocking=False cannot be distributed: the ranks "
                             "would learn of a dropped step at different steps; use blocking=True (the "
                             "default under 'raise') or on_nonfinite='skip'")
        self._on_nonfinite = on_nonfinite
        self._blocking = blocking
        self._workspace_limit = -1 if workspace_limit is None else workspace_limit
        self._megabatch = bool(megabatch)
        _LIVE.add(self)
        self._engine = None
        self._engine_generation = 0  # engines built so far
        self._captured_generation: Optional[int] = None  # the engine a CUDA-graph capture stepped
        # Distributed: the next step first checks every rank's groups with one all-reduce (see
        # _agree_on_groups); set where every rank's step builds its first engine alike.
        self._agree_first = True
        self._switched_from: Dict[torch.Tensor, Any] = {}  # see _rebuild
        self._engine_key = None
        self._engine_params: List[torch.Tensor] = []
        self._engine_states: List[Dict[str, Any]] = []
        self._absent: List[int] = []  # the engine's parameters the last step left alone (no gradient)
        self._adamw_steps: List[Tuple[Dict[str, Any], Any]] = []  # see _rebuild
        self._watched_state, self._watched_version = None, 0  # the state the engine registered (_state_replaced)
        self._engine_cuda = False
        self._applied_seen = self._skipped_seen = 0  # engine counters already folded into state
        self._counters_pending = False
        self._unfolded = False      # a blocking step ran and its count is not folded yet (see _step)
        self._bumps = None          # state[p]["step"] values a fold has yet to write (_fold_counters)
        self._raised_pending = 0    # dropped steps a deferred on_nonfinite='raise' has yet to raise
        # step() holds _step_lock (one stepping thread; a second is refused); a step's body,
        # state_dict(), load_state_dict() and the counters' folds hold _state_lock (others wait).
        self._step_lock, self._state_lock = threading.RLock(), threading.RLock()
        self._engine_groups: List[int] = []
        self._steps_skipped = 0
        self._dirty = True
        self._given_grads = False  # the engine takes each step's gradients (DTensor shards)
        self._unregistered: List[torch.Tensor] = []  # parameters without a gradient at the last rebuild
        self._alias_index = None  # see _check_aliasing
        # The kind of algorithm ("matrix", "adamw", "lion") each parameter's state was made for:
        # a group switched to another kind starts its parameters' state afresh (the kinds share
        # state names, not meanings).
        self._kinds: Dict[torch.Tensor, str] = {}
        self._pushed: Dict[int, Tuple] = {}  # see _push_groups
        self._pushed_to = None
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
        blocking = state.get("_blocking", getattr(self, "_blocking", None))
        super().__setstate__(state)
        if "_step_lock" not in self.__dict__:  # (load_state_dict keeps those a step may hold)
            self._step_lock, self._state_lock = threading.RLock(), threading.RLock()
        self._unfolded, self._bumps = False, None
        self._blocking = blocking
        self._raised_pending = 0
        self._on_nonfinite = on_nonfinite
        self._workspace_limit = workspace_limit
        self._mesh = mesh
        self._megabatch = megabatch
        self._given_grads = False
        self._unregistered = []
        self._alias_index = None
        # The state was made for its group (__getstate__ applied pending switches): its kind is the
        # group's, so a later switch of the group is told as one.
        self._kinds = {p: _kind(g.get("algorithm")) for g in self.param_groups for p in g["params"]}
        self._pushed, self._pushed_to = {}, None
        self._engine, self._engine_key, self._engine_params, self._engine_groups = None, None, [], []
        # (load_state_dict keeps them: a graph captured before it is refused at its next refresh)
        self._engine_generation = getattr(self, "_engine_generation", 0)
        self._captured_generation = getattr(self, "_captured_generation", None)
        self._agree_first = True
        self._switched_from = {}
        _LIVE.add(self)
        self._engine_states, self._adamw_steps, self._absent = [], [], []
        self._watched_state, self._watched_version = None, 0
        self._engine_cuda = False
        self._applied_seen = self._skipped_seen = 0
        self._counters_pending = False
        self._steps_skipped = getattr(self, "_steps_skipped", 0)
        self._dirty = True
        self._fill_missing_keys()

    def _fill_missing_keys(self) -> None:
        # Groups (and defaults) pickled by an older version may lack keys added since: a fresh
        # optimizer's defaults supply them, as load_state_dict does for the groups it loads.
        fresh = _fresh_defaults(type(self))
        for k, v in fresh.items():
            self.defaults.setdefault(k, v)
        keys = fresh or [k for k in self.defaults if k not in _TORCH_DEFAULT_KEYS]
        for g in self.param_groups:
            for k in keys:  # torch's own defaults (differentiable, ...) stay out of the groups
                g.setdefault(k, self.defaults[k])

    def _switched_state(self) -> Dict[torch.Tensor, Dict[str, Any]]:
        """The fresh state of the parameters whose group moved to another kind of algorithm
        (adamw -> lion, dion3 -> adamw, ...) since their last step, or whose construction-time
        zeros no longer fit their group (flatten, momentum_dtype set before the first step): they
        start afresh at the next step, so a checkpoint or copy taken before it holds that. Nothing
        here changes: the next step decides on the groups as they are then."""
        out = {}
        for g in self.param_groups:
            kind, state_kind = _kind(g.get("algorithm")), self._state_kind(g)
            for p in g["params"]:
                switched = self._restarts_with_group(p, kind)
                old = {} if switched else self.state.get(p)
                if not old and not switched:
                    continue
                try:
                    fresh = _state_tensors(g, p, old, state_kind)
                except (ValueError, RuntimeError):
                    continue  # a group the next step refuses anyway
                if not switched and old.get("step", 0):
                    # Stepped state keeps its values; a tensor the group's algorithm needs and the
                    # state lacks (muon -> dion3: the variance) starts at zero at the next step.
                    missing = {k: t for k, t in fresh.items() if k not in old}
                    if missing:
                        out[p] = dict(old, **missing)
                elif switched or any(t is not old.get(k) for k, t in fresh.items()):
                    out[p] = dict(fresh, step=0)
        return out

    def _restarts_with_group(self, p: torch.Tensor, kind: str) -> bool:
        """Whether p's state starts afresh at its group's next step: the group moved to another
        kind of algorithm since the state was made (a frozen parameter without state has none)."""
        return self._kinds.get(p, kind) != kind and (p.requires_grad or bool(self.state.get(p)))

    def __getstate__(self) -> Dict[str, Any]:
        self._sync_counters()  # a copy holds the steps the weights took (pending counts folded)
        state = super().__getstate__()
        switched = self._switched_state()
        if switched:
            state["state"] = collections.defaultdict(dict, {p: switched.get(p, st) for p, st in self.state.items()})
        state["_on_nonfinite"] = self._on_nonfinite
        state["_workspace_limit"] = self._workspace_limit
        state["_steps_skipped"] = self._steps_skipped
        state["_mesh"] = self._mesh
        state["_megabatch"] = self._megabatch
        state["_blocking"] = self._blocking
        return state

    def __deepcopy__(self, memo: Dict[int, Any]) -> "_EngineOptimizer":
        # A process group is not copied (it cannot be): the copy steps over the same group, as a
        # copied DeviceMesh names the same groups. Otherwise what deepcopy does by default.
        mesh = self._mesh
        if isinstance(mesh, _torch_dist.ProcessGroup):
            memo.setdefault(id(mesh), mesh)
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return new

    def __copy__(self) -> "_EngineOptimizer":
        # What copy.copy does by default, which would go through __reduce_ex__ below.
        new = type(self).__new__(type(self))
        new.__setstate__(self.__getstate__())
        return new

    def __reduce_ex__(self, protocol):
        if isinstance(self.__dict__.get("_mesh_held"), weakref.ref):
            raise TypeError(f"dion3: a {self._name} optimizer over a ProcessGroup cannot be pickled (a process group "
                            "cannot be); save its state_dict() and load it into one made over the group where it "
                            "is needed")
        return super().__reduce_ex__(protocol)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        try:
            super().add_param_group(param_group)
        except ValueError as e:
            if "more than one parameter group" not in str(e):
                raise
            # torch's message names no parameter; ours does (its params are a list of tensors by now).
            index = self._alias_index
            self.param_groups.append(param_group)
            try:
                self._check_aliasing(len(self.param_groups) - 1)
            finally:
                self.param_groups.pop()
                self._alias_index = index
            raise
        try:
            self._check_group(len(self.param_groups) - 1, self.param_groups[-1])
            self._check_aliasing(len(self.param_groups) - 1)
        except Exception:
            self.param_groups.pop()  # nothing half-added
            raise
        # State exists from construction (as the reference's): every rank holds the same state
        # keys whatever got a gradient, and torch.distributed.checkpoint finds nothing to create.
        # A frozen parameter (requires_grad=False on every rank) gets its state at its first step,
        # as in torch.optim: a model trained in part holds no momentum for the rest.
        group = self.param_groups[-1]
        for p in group["params"]:
            if p.requires_grad and not self.state.get(p):
                self.state[p] = self._zero_state(group, p)
                self._kinds[p] = _kind(group["algorithm"])
        self._dirty = True

    @_STATE_MADE
    def _zero_state(self, group: Dict[str, Any], p: torch.Tensor) -> Dict[str, Any]:
        st: Dict[str, Any] = {}
        for name, dtype, shape in _state_shapes(group, p, self._state_kind(group)):
            t = _dist.zeros_like_layout(p, shape, dtype, _single_dim(group, name))
            t._dion3_initial = True  # made here, not given: may be remade if the group's settings change
            st[name] = t
        st["step"] = 0
        return st

    @_under_state_lock
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        # torch's load hooks run where torch runs them: the pre-hooks on the dict before anything
        # reads it, the post-hooks once everything (dion3's own state tensors too) is in place.
        names = ("_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")
        held = {name: getattr(self, name) for name in names if hasattr(self, name)}
        pre, post = held.get(names[0], {}), held.get(names[1], {})
        if isinstance(state_dict, dict):
            state_dict = state_dict.copy()  # shallow, as torch's: a hook may edit its keys
        for hook in list(pre.values()):
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        skipped = _saved_steps_skipped(state_dict)
        self._sync_counters()  # steps still in flight count before the loaded counter replaces ours
        # Everything is checked, and every state tensor made, before anything is replaced: a
        # refused load leaves the optimizer as it was. What is refused here is refused on every
        # rank (_loaded_state's agreement): a rank raising alone would leave the others waiting.
        try:
            if skipped is not None and (isinstance(skipped, bool) or not isinstance(skipped, numbers.Integral) or
                                        not 0 <= skipped <= _MAX_STEP):
                raise ValueError(f"dion3: the state_dict's 'steps_skipped' must be a count in [0, 2**62]; "
                                 f"got {skipped!r}")
            state_dict = _without_names_that_do_not_fit(self._from_saved_layout(_without_empty_entries(state_dict)))
            malformed = None
        except Exception as e:  # noqa: BLE001 - refused in _loaded_state, on every rank
            malformed = e
        loaded = self._loaded_state(state_dict, malformed)
        # torch's load replaces state and param_groups whole (new objects), and the dion3 tensors go
        # in after it: anything that stops the load part way (a Ctrl-C) puts the optimizer's own
        # attributes back, and with them the state as it was (one update, not interruptible).
        before = dict(self.__dict__)
        try:
            try:
                for name, hooks in held.items():  # run above and below, not again inside torch's load
                    setattr(self, name, type(hooks)())
                super().load_state_dict(_without_loaded_tensors(state_dict, self.param_groups, loaded))
            finally:
                for name, hooks in held.items():
                    setattr(self, name, hooks)
            # The checked tensors, in the dtypes the groups keep (fp32 variance, and an optional fp32
            # momentum, next to low-precision weights), which torch's load did not see.
            for p, st in loaded.items():
                self.state[p].update(st)
            self._kinds = {p: _kind(g["algorithm"]) for g in self.param_groups for p in g["params"]}
            self._fill_missing_keys()
            self._dirty = True
            if skipped is not None:
                self._steps_skipped = int(skipped)
        except BaseException:
            self.__dict__.update(before)
            raise
        for hook in list(post.values()):
            hook(self)

    def _from_saved_layout(self, state_dict: Dict[str, Any]) -> Dict[str, Any]:
        """A state_dict in the reference package's layout (what state_dict() writes), or in an
        earlier dion3 version's, as this optimizer's groups and state hold it: "nordion2" and
        "dion3" are one algorithm (the optimizer's own name is kept); beta1/beta2 become betas; a
        parameter without its own step counter takes its group's; earlier state names are
        renamed. The input is not modified; what cannot be read is left to _loaded_state's errors."""
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("param_groups"), list) \
                or not isinstance(state_dict.get("state"), dict):
            return state_dict
        saved_state = dict(state_dict["state"])
        groups = []
        for gi, saved in enumerate(state_dict["param_groups"]):
            if not isinstance(saved, dict):
                groups.append(saved)
                continue
            g = dict(saved)
            mine = self.param_groups[gi] if gi < len(self.param_groups) else None
            same_algorithm = ("dion3", "nordion2")
            if mine is not None and g.get("algorithm") in same_algorithm and mine["algorithm"] in same_algorithm:
                g["algorithm"] = mine["algorithm"]
            if "beta1" in g or "beta2" in g:
                betas = g.get("betas", mine["betas"] if mine is not None else self.defaults["betas"])
                pair = tuple(betas) if isinstance(betas, (tuple, list)) and len(betas) == 2 else (None, None)
                # state_dict() writes both spellings; one edited without the other (a load pre-hook
                # setting betas, say) leaves no way to tell which is meant.
                if "betas" in g and any(k in g and _real(g[k]) and _real(b) and float(g[k]) != float(b)
                                        for k, b in zip(("beta1", "beta2"), pair)):
                    raise ValueError(f"dion3: load_state_dict: parameter group {gi} of the state_dict holds betas "
                                     f"{tuple(betas)!r} and beta1/beta2 ({g.get('beta1', pair[0])!r}, "
                                     f"{g.get('beta2', pair[1])!r}), which disagree; set both spellings, or "
                                     "remove beta1/beta2 (the reference package's keys)")
                b1, b2 = g.pop("beta1", pair[0]), g.pop("beta2", pair[1])
                # Numbers as saved; anything else is left to the group's check, which names it.
                g["betas"] = (b1, b2) if not all(isinstance(b, numbers.Real) for b in (b1, b2)) \
                    else (float(b1), float(b2))
            if "ema_momentum" in self.defaults and g.get("algorithm") in ("muon", "normuon"):
                g.setdefault("ema_momentum", False)  # saved before the setting existed, or by the reference: summed
            group_step = g.pop("step", None)
            g.pop("steps_skipped", None)  # the optimizer's counter (_saved_steps_skipped), not a setting
            if not isinstance(g.get("algorithm", ""), str):
                groups.append(g)  # refused by the group's check, which names it
                continue
            kind = self._state_kind(g)
            for j, pid in enumerate(g.get("params", [])):
                st = saved_state.get(pid)
                if not isinstance(st, dict):
                    continue
                st = dict(st)
                for old_name, name in _OLD_NAMES.get(kind, {}).items():
                    if old_name in st and name not in st:
                        st[name] = st.pop(old_name)
                if kind == "matrix" and mine is not None and j < len(mine["params"]) \
                        and mine["params"][j].dim() >= 2 and isinstance(st.get("variance_neuron"), torch.Tensor):
                    # Earlier versions kept one flat value per row. (A parameter that is no matrix
                    # here is left to the checks that name it.)
                    full = dict(self.defaults, **g)
                    try:
                        shapes = _state_shapes(full, mine["params"][j], kind)
                    except (RuntimeError, ValueError):
                        shapes = []  # settings the group's check refuses, naming them
                    want = dict((n, sh) for n, _, sh in shapes).get("variance_neuron")
                    v = st["variance_neuron"]
                    if want is not None and v.dim() == 1 and v.numel() == math.prod(want):
                        try:
                            st["variance_neuron"] = v.view(want)
                        except RuntimeError:
                            pass  # left to the shape check, which names it
                if "step" not in st and group_step is not None:
                    st["step"] = group_step
                saved_state[pid] = st
            groups.append(g)
        return dict(state_dict, state=saved_state, param_groups=groups)

    def _loaded_state(self, state_dict: Dict[str, Any],
                      malformed: Optional[BaseException] = None) -> Dict[torch.Tensor, Dict[str, Any]]:
        """The state load_state_dict would give each parameter: every state tensor the group's
        algorithm needs, of its shape, converted to its dtype (and this rank's part of it), finite,
        second moments not negative, and a step counter. ValueError naming the parameter and the
        tensor otherwise. Under a distributed mesh, ranks agree on the verdict (one tiny all-reduce
        per mesh dimension), so that all refuse together."""
        # 1. What can be told from metadata alone: the ranks agree on it before step 2, whose
        #    full_tensor() calls are collectives that a rank refusing here would never join.
        plan, problem = [], None
        try:
            if malformed is not None:
                raise malformed
            plan = self._load_plan(state_dict)
        except ValueError as e:
            problem = str(e)
        except MemoryError:  # not the checkpoint's fault: said so, and refused with the ranks as the rest
            problem = "dion3: load_state_dict: out of memory while checking the state_dict; nothing was loaded"
        except Exception as e:  # noqa: BLE001 - a structure no check foresaw: refused like the rest
            problem = (f"dion3: load_state_dict: the state_dict is malformed ({type(e).__name__}: {e}); "
                       "nothing was loaded")
        self._agree_on_load(problem)  # raises this rank's problem, or another rank's refusal
        # 2. The tensors as this optimizer will hold them, and their values (rank-local for shards).
        loaded: Dict[torch.Tensor, Dict[str, Any]] = {}
        problem = None
        for p, who, group, st, step in plan:
            out: Dict[str, Any] = {"step": step}
            for name, dtype, shape in _state_shapes(group, p, self._state_kind(group)):
                t = _loaded_tensor(st[name], p, group, name, shape, dtype)
                if problem is None:
                    bad = _bad_value(_dist.local(t), name in _SECOND_MOMENTS)
                    if bad is not None:
                        shard = " (this rank's shard)" if _dist.is_dtensor(t) else ""
                        problem = (f"dion3: load_state_dict: {who}: state '{name}' ({_dtype_name(dtype)}){shard} "
                                   f"holds {bad}; nothing was loaded")
                out[name] = t
            for name, value in st.items():
                # A second moment the group's algorithm does not use now (dion3 -> muon keeps the
                # variance for a switch back) keeps its dtype: torch's load would cast it to p's.
                if name in _SECOND_MOMENTS and name not in out and isinstance(value, torch.Tensor) \
                        and value.is_floating_point():
                    try:
                        out[name] = _loaded_tensor(value, p, group, name, tuple(value.shape), value.dtype)
                    except (RuntimeError, ValueError):
                        pass  # shaped for another parameter: left to torch's load, as any other entry
            loaded[p] = out
        self._agree_on_load(problem)
        return loaded

    def _load_plan(self, state_dict: Dict[str, Any]) -> List[Any]:
        """Step 1 of _loaded_state: the checks of groups, keys, shapes, dtypes, layouts and step
        counters, and for each parameter what step 2 loads. ValueError naming what is wrong."""
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("dion3: load_state_dict needs a dict with 'state' and 'param_groups' "
                             "(what state_dict() returns)")
        saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"dion3: load_state_dict: the state_dict has {len(saved_groups)} parameter groups "
                             f"but the optimizer has {len(self.param_groups)}"
                             + _regrouped(saved_groups, self.param_groups))
        _refuse_misplaced_names(saved_groups, self.param_groups)
        plan = []
        for gi, (saved, mine) in enumerate(zip(saved_groups, self.param_groups)):
            if not isinstance(saved, dict) or not isinstance(saved.get("params"), (list, tuple)):
                raise ValueError(f"dion3: load_state_dict: parameter group {gi} of the state_dict is not a dict "
                                 "with a 'params' list (what state_dict() returns)")
            if len(saved["params"]) != len(mine["params"]):
                raise ValueError(f"dion3: load_state_dict: parameter group {gi} of the state_dict has "
                                 f"{len(saved['params'])} parameters but the optimizer's has {len(mine['params'])}"
                                 + _regrouped(saved_groups, self.param_groups))
            names_saved, names_mine = saved.get("param_names"), mine.get("param_names")
            if isinstance(names_saved, list) and isinstance(names_mine, list) and names_saved != names_mine \
                    and sorted(map(str, names_saved)) == sorted(map(str, names_mine)):
                # State is matched by position: the same names in another order would hand each
                # parameter another one's state (names that differ otherwise may be a prefix, "module.").
                j = next(i for i, (a, b) in enumerate(zip(names_saved, names_mine)) if a != b)
                raise ValueError(f"dion3: load_state_dict: parameter group {gi} of the state_dict holds the same "
                                 f"parameter names in another order (position {j}: '{names_saved[j]}' there, "
                                 f"'{names_mine[j]}' here); state is matched by position, so build the "
                                 "optimizer's groups in the checkpoint's order")
            group = {k: v for k, v in saved.items() if k != "params"}  # as torch will set it
            group["params"] = mine["params"]
            if "param_names" in mine and "param_names" not in saved:
                group["param_names"] = mine["param_names"]
            for k, v in self.defaults.items():
                group.setdefault(k, v)
            try:
                self._check_group(gi, group)
            except ValueError as e:
                if "unknown setting" not in str(e):
                    raise
                # Keys this class does not know: most likely another optimizer's checkpoint.
                cls = type(self)
                where = cls.__module__ if not cls.__module__.startswith("dion3") else \
                    "dion3.optim" if cls.__module__ == "dion3.optim" else "dion3"
                raise ValueError(f"{e} (in the state_dict: was it saved by another optimizer class than "
                                 f"{where}.{cls.__qualname__}?)") from None
            state_kind = self._state_kind(group)
            for j, (pid, p) in enumerate(zip(saved["params"], mine["params"])):
                who = f"parameter {j} '{self._param_name(group, gi, j)}' of group {gi}"
                st = saved_state.get(pid)
                if st is None and not p.requires_grad:
                    continue  # frozen, without state (as it was made): it gets it at its first step
                if st is None:
                    # No state saved: frozen when the checkpoint was written (or never stepped under
                    # torch.optim, which makes none until then). It starts afresh, as torch's do.
                    st = dict(_state_tensors(group, p, {}, state_kind), step=0)
                if not isinstance(st, dict):
                    raise ValueError(f"dion3: load_state_dict: {who}: its state in the state_dict is a "
                                     f"{type(st).__name__}, not a dict")
                if "step" not in st:
                    raise ValueError(f"dion3: load_state_dict: {who} has no step counter ('step') in the "
                                     "state_dict; it cannot be guessed (AdamW's bias correction reads it)")
                step = _step_count(st["step"], who)
                for name, dtype, shape in _state_shapes(group, p, state_kind):
                    value = st.get(name)
                    what = f"{who}: state '{name}'"
                    if value is None:
                        raise ValueError(f"dion3: load_state_dict: {who} has no state '{name}' in the "
                                         f"state_dict ({group['algorithm']} needs it)")
                    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                        kind = _dtype_name(value.dtype) if isinstance(value, torch.Tensor) else type(value).__name__
                        raise ValueError(f"dion3: load_state_dict: {what} is {kind}, not a floating-point tensor")
                    if value.device.type == "meta":
                        raise ValueError(f"dion3: load_state_dict: {what} is on the meta device: it holds no values")
                    if tuple(value.shape) != tuple(shape):
                        raise ValueError(f"dion3: load_state_dict: {what} has shape {list(value.shape)}, "
                                         f"expected {list(shape)}")
                    if _dist.is_dtensor(value) and not _dist.is_dtensor(p) and not _dist.gatherable(value):
                        raise ValueError(f"dion3: load_state_dict: {what} is a DTensor on {value.device_mesh}, whose "
                                         "ranks this process cannot gather it from (load a resharded checkpoint "
                                         "through torch.distributed.checkpoint)")
                    if _dist.is_dtensor(value) and _dist.is_dtensor(p):
                        want = _dist._placements_for(tuple(shape), p.placements, tuple(p.shape),
                                                     _single_dim(group, name))
                        if not _dist.same_mesh(value.device_mesh, p.device_mesh) or tuple(value.placements) != want:
                            raise ValueError(f"dion3: load_state_dict: {what} is placed {list(value.placements)} "
                                             f"on {value.device_mesh}, expected {list(want)} on {p.device_mesh} "
                                             "(load a resharded checkpoint through torch.distributed.checkpoint)")
                plan.append((p, who, group, st, step))
        return plan

    def _agree_on_load(self, problem: Optional[str]) -> None:
        """Raises `problem` (this rank's) or, under a distributed mesh, the refusal of another rank:
        one all-reduce per mesh dimension of the highest refusing rank, so every rank refuses."""
        self._agree(problem, lambda r: f"dion3: load_state_dict: rank {r} refused the state_dict (its error says "
                                       "what is wrong there); nothing was loaded on any rank")

    def _agree_on_groups(self) -> None:
        """At a step that builds the first engine on every rank (the first step, the first after
        load_state_dict), where there is no plan yet to refuse through (Optimizer::refuse_invalid):
        every rank checks its groups and registers its parameters with its new engine, and one
        all-reduce per mesh dimension makes a refusal on one rank alone (an invalid setting, tied
        weights, state of the wrong shape) raise on every rank, instead of leaving the others
        waiting or pairing their step with that rank's next one."""
        problem: Optional[BaseException] = None
        try:
            self._check_groups()
            key = self._registration_key()
            stale = self._stale(key)
            if self._has_gradients():
                if stale:
                    self._replan(key, agreeing=True)
            elif stale or self._engine is None:
                # The step will register this rank's parameters only to refuse it: registered
                # here first, what would fail there fails before the others hear of it.
                self._refuse_without_gradients(key, dry=True)
        except Exception as e:  # noqa: BLE001 - raised below, after the others heard of it
            problem = e
        try:
            self._agree(problem, lambda r: f"dion3: another rank refused this step (rank {r}'s error says why); "
                                           f"{_NOT_APPLIED}")
        except Exception:
            if problem is None and self._switched_from:
                self._restore_switched()  # as a refused first step would (_run_first): nothing applied
            raise
        self._agree_first = False

    def _agreement_groups(self) -> List[Any]:
        """The process groups an agreement reduces over: the mesh's, and every dimension of the
        parameters' meshes (each once)."""
        groups: List[Any] = []
        if isinstance(self._mesh, _torch_dist.ProcessGroup):
            groups.append(self._mesh)
        elif self._mesh is not None:
            meshes = [self._mesh] + [p.device_mesh for g in self.param_groups for p in g["params"]
                                     if _dist.is_dtensor(p)]
            seen: List[Any] = []
            for m in meshes:
                if any(_dist.same_mesh(m, s) for s in seen):
                    continue
                seen.append(m)
                groups.extend(m.get_group(d) for d in range(m.ndim))
        return groups

    def _agreement_device(self) -> torch.device:
        first = next((p for g in self.param_groups for p in g["params"]), None)
        return _dist.local(first).device if first is not None else torch.device("cpu")

    def _agree_on_partial_gradients(self) -> None:
        """A DTensor weight replicated over a mesh dimension may get a Partial gradient there
        (sequence or tensor parallelism), which is summed over the ranks (a collective) before the
        step: every rank must then have that gradient, or none. One all-reduce per mesh dimension
        tells it before any of those collectives run, and the host waits for its answer; a gradient
        on some ranks only is refused on every rank. Not where steps only enqueue (CUDA with
        blocking=False), which would then wait here every step."""
        if self._mesh is None or not self._refusals_reach_every_rank():
            return
        which = [(gi, j, p) for gi, g in enumerate(self.param_groups) for j, p in enumerate(g["params"])
                 if _dist.is_dtensor(p) and p.requires_grad and any(isinstance(pl, _dist.Replicate)
                                                                   for pl in p.placements)]
        if not which:
            return
        groups = self._agreement_groups()
        # [has, lacks] per weight, reduced with MAX: both 1 where the ranks differ.
        have = torch.tensor([[p.grad is not None, p.grad is None] for _, _, p in which], dtype=torch.int64,
                            device=self._agreement_device())
        for pg in groups:
            _torch_dist.all_reduce(have, op=_torch_dist.ReduceOp.MAX, group=pg)
        mixed = next(((gi, j) for (gi, j, _), (h, l) in zip(which, have.tolist()) if h and l), None)
        if mixed is not None:
            gi, j = mixed
            raise ValueError(f"dion3: parameter {j} '{self._param_name(self.param_groups[gi], gi, j)}' of group {gi} "
                             "has a gradient on some ranks and none on others; a replicated weight's gradient "
                             "(summed over the ranks when it is Partial) must be on every rank or on none; "
                             f"{_NOT_APPLIED}")

    def _agree(self, problem: Optional[Union[str, BaseException]], refused_by) -> None:
        """Raises `problem` (this rank's) or, under a distributed mesh, refused_by(rank) for the
        highest refusing rank: one all-reduce per mesh dimension, so every rank raises."""
        groups = self._agreement_groups()
        if groups:
            flag = torch.tensor([_torch_dist.get_rank() + 1 if problem else 0], dtype=torch.int64,
                                device=self._agreement_device())
            for pg in groups:
                _torch_dist.all_reduce(flag, op=_torch_dist.ReduceOp.MAX, group=pg)
            refusing = int(flag.item()) - 1
            if problem is None and refusing >= 0:
                problem = refused_by(refusing)
        if isinstance(problem, BaseException):
            raise problem
        if problem is not None:
            raise ValueError(problem)

    # Dynamo does not trace into the step (the engine is an opaque C++ call): a compiled training
    # function that calls opt.step() gets a clean graph break instead of a warning.
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure=None):
        # One thread at a time: the engine steps without the GIL, and a second thread's step
        # beneath it would rebind gradients or rebuild the engine (the engine refuses its own calls
        # too; this also keeps the counting in Python whole). The same thread may come back in.
        lock = self._step_lock
        if lock._is_owned():  # this thread's own step, re-entered (a hook, a closure)
            return self._locked_step(closure)
        try:
            if not lock.acquire(blocking=False):
                raise RuntimeError("dion3: this optimizer is stepping in another thread: an optimizer steps in "
                                   "one thread at a time")
            return self._locked_step(closure)
        finally:
            # Released whether or not the acquire's result was seen: a signal's exception may land
            # right after it. Not this thread's lock (the refusal): release() refuses, nothing else.
            try:
                lock.release()
            except RuntimeError:
                pass

    def _locked_step(self, closure):
        loss = None
        if closure is not None:  # outside _state_lock: what it waits for may read the counters
            with torch.enable_grad():
                loss = closure()
        try:
            with self._state_lock:
                return self._step(loss)
        except Exception as e:
            # Any error (a NonFiniteError under blocking=False comes on one rank first): a refusal
            # of this rank's (_push_or_refuse refuses whatever it raises) reaches the other ranks
            # as a ValueError; all of them must then agree first at the next step.
            if not _capturing():  # which cannot wait for the device
                if isinstance(e, ValueError):
                    # A refused step may report an earlier enqueued one the ranks disagreed on,
                    # dropped on the device though counted here when it was enqueued.
                    self._sync_counters()
                # Refused on every rank (where steps block): the next step's registration may fail
                # on a rank that has no plan to refuse through (none made, or dropped), so the
                # ranks check it together first.
                self._agree_first = self._agree_first or self._refusals_reach_every_rank()
            raise

    def _refusals_reach_every_rank(self) -> bool:
        """Whether a refused step raises on every rank at that step: where steps block (the CPU;
        CUDA with blocking), not where they only enqueue (the others then drop it silently). The
        same answer on every rank: it depends on the parameters' device and the settings only."""
        first = next((p for g in self.param_groups for p in g["params"]), None)
        return first is None or _dist.local(first).device.type != "cuda" or self._blocks()

    def _step(self, loss):
        self._finish_bumps()
        if self._unfolded and not _capturing():
            self._sync_counters()  # a step cut short before its count: counted for its own parameters
        if self._mesh is not None and not _capturing():
            self._agree_on_partial_gradients()  # first: the step sums each Partial gradient
        if self._agree_first and self._mesh is not None and not _capturing():
            self._agree_on_groups()
        key = self._registration_key()
        stale = self._stale(key)
        if (stale or self._engine is None) and self._mesh is not None and not self._has_gradients():
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise CaptureNotReady("dion3: no parameter of this rank has a gradient and the step must be "
                                      "planned anew; run one eager step before capturing")
            self._refuse_without_gradients(key)
            self._note_never_a_gradient()
            return loss
        if (stale or self._engine is None) and _capturing():
            # Building an engine or a plan allocates and uploads: not in a capture.
            raise CaptureNotReady("dion3: the step must be planned anew (the first step, or the parameters, their "
                                  "groups or storage changed); run one eager step before capturing")
        if stale:
            self._replan(key)
        engine = self._engine
        if engine is None:  # no parameter had a gradient: look again (rare, so done in Python)
            if not self._has_gradients():
                self._note_never_a_gradient()
                return loss
            self._rebuild(key)
            engine = self._engine
        try:
            self._push_or_refuse(engine, replannable=True)
        except _Replan:
            # A group's parameters changed as well as its settings: the new ones are what count.
            if _capturing():
                raise CaptureNotReady("dion3: the parameters with gradients, their groups or their storage changed "
                                      "since the last step; run one eager step before capturing") from None
            engine = self._replanned(key)
            if engine is None:
                return loss
        if self._engine_cuda and torch.cuda.is_current_stream_capturing():
            # CUDA-graph capture: the engine's capture-safe step (no host synchronisation). Step
            # counters then advance on the device only; _sync_counters() brings them back.
            if self._run_first(engine, True) < 0:
                raise CaptureNotReady("dion3: the parameters with gradients, their groups or their storage "
                                      "changed since the last step; run one eager step before capturing")
            self._absent = engine.absent()  # what the replays step (counted by _sync_counters)
            self._counters_pending = True
            # The engine the graph points into: after a rebuild (another engine) it cannot be replayed.
            self._captured_generation = self._engine_generation
            return loss
        if getattr(self, "_replayed", False):
            # Replays are counted for the parameters the capture stepped, before this step may step
            # others, and before the poll below, which then reports a dropped replay at once.
            self._sync_counters()
            self._replayed = False
        self._raise_deferred(poll=True)
        # A step that does not block only enqueues: nothing waits for the GPU, and its verdict
        # comes back through an asynchronous copy of the engine's counters (see _sync_counters).
        asynchronous = self._engine_cuda and not self._blocks()

        def run(engine):
            if not asynchronous:
                # Counted from the engine's counters (_sync_counters), not by one: a KeyboardInterrupt
                # that lands between the engine's return and the count is then folded in later, so
                # a checkpoint saved on it holds the step the weights took.
                self._counters_pending = self._unfolded = True
            # The engine reads each parameter's .grad itself (no per-parameter Python work per step).
            return self._run_first(engine, asynchronous)
        if asynchronous and self._counters_pending and self._absence_changed(engine):
            # A step in flight that the device drops is taken back from the parameters the steps
            # in flight stepped (_counted_states): wait for their verdicts before that set changes.
            self._sync_counters()
        status = run(engine)
        if status < 0:  # parameters, their groups or gradients changed, or a weight or state tensor moved
            if not self._has_gradients():  # nothing to step: the plan stays for the next step
                if self._mesh is not None:
                    self._refuse_without_gradients(key)  # with this engine: ValueError unless no rank stepped
                return loss
            engine = self._replanned(key)
            if engine is None:
                return loss
            status = run(engine)
            if status < 0:
                raise RuntimeError("dion3: internal error: the engine still asks for a rebuild")
        # Matrices without a gradient were left alone (the engine's plan keeps them): not counted.
        self._absent = engine.absent()
        self._stepped_once = True  # a gradient was seen (see _note_never_a_gradient)
        # Counted from the verdict (no read of the engine's counters); an enqueued step counts as
        # applied, and one the device drops is taken back when the engine posts its counters.
        self._fold_counters(self._applied_seen + (status > 0), self._skipped_seen + (status == 0))
        if asynchronous:
            self._counters_pending = True
        return loss

    def _note_never_a_gradient(self) -> None:
        """A step() found no gradient, and no step of this optimizer has ever run with one: at the
        third such call, say what usually causes it (once; torch's optimizers stay silent)."""
        if getattr(self, "_stepped_once", False):
            return
        self._gradless_calls = getattr(self, "_gradless_calls", 0) + 1
        if self._gradless_calls == 3:
            warnings.warn("dion3: step() was called 3 times and no parameter of this optimizer has had a gradient "
                          "yet, so nothing was stepped. If the model was wrapped after the optimizer was built "
                          "(FSDP2's fully_shard replaces its parameters), the optimizer holds parameters the model "
                          "no longer uses: build it after wrapping the model", RuntimeWarning, stacklevel=2)

    def _counted_states(self):
        """The state dicts of the parameters the last step stepped (replays of a capture step the
        same ones; an enqueued step that is dropped later is taken back from the same ones)."""
        if not self._absent:
            return self._engine_states
        absent = set(self._absent)
        return [st for i, st in enumerate(self._engine_states) if i not in absent]

    def _absence_changed(self, engine) -> bool:
        """Whether a replay of the last step would step other parameters than have a gradient now."""
        if not self._given_grads:
            return engine.absence_changed()
        now = [i for i, p in enumerate(self._engine_params) if p.grad is None]
        return now != self._absent

    def _stale(self, key) -> bool:
        """Whether the engine must be built anew for the groups as they are (see _registration_key)."""
        return self._dirty or key != self._engine_key or self._state_replaced()

    def _has_gradients(self) -> bool:
        return any(p.grad is not None for g in self.param_groups for p in g["params"])

    def _state_replaced(self) -> bool:
        """Whether optimizer.state, or a parameter's dict in it, was replaced (state = ...,
        state[p] = {}, state.clear()) since the engine registered the state it holds, or an
        AdamW parameter's "step" was set (its bias correction reads the engine's count, which
        the rebuild sets from it)."""
        if self.state is not self._watched_state or self.state.version != self._watched_version:
            return True
        seen = self._applied_seen
        return any(st.get("step") != base + seen for st, base in self._adamw_steps)

    def _registration_key(self) -> Tuple:
        """What the engine's registration depends on: the groups, their sizes and structure."""
        return tuple((id(g), len(g["params"])) + _structure_key(g) for g in self.param_groups)

    def _push_groups(self, engine) -> None:
        """The groups' current settings into the engine, before every step: a group whose values
        (the keys the engine reads) are unchanged plain values since the last push is skipped."""
        if self._pushed_to is not engine:
            self._pushed, self._pushed_to = {}, engine
        for i, gi in enumerate(self._engine_groups):
            group = self.param_groups[gi]
            last = self._pushed.get(i)
            grown = last is not None and len(group) != last[2]
            snapshot = _plain_snapshot(group, last[0]) if last is not None and last[1] is not None and not grown \
                else None
            if snapshot is not None and snapshot == last[1]:
                continue
            changed = [k for k, now, then in zip(last[0], snapshot, last[1]) if now != then] \
                if snapshot is not None else None
            # Only what schedulers move (lr, weight decay): the last config with those numbers.
            scheduled = bool(changed) and _SCHEDULED_KEYS.issuperset(changed)
            if not scheduled:
                if grown:
                    self._check_keys(gi, group)  # a key added since (e.g. another optimizer's name for one)
                view = _ReadKeys(group)
                _refuse_unimplemented(gi, view)  # read through the view: its keys join the snapshot
            try:  # validated here, while the engine still holds the plan a refusal needs (see step)
                if scheduled:
                    keys, cfg = last[0], dict(last[3], **{k: _number(k, group[k]) for k in changed})
                else:
                    cfg = _engine_config(self._engine_group(view))
                    keys = tuple(dict.fromkeys(view.read))  # a change of those comes here
                    snapshot = _plain_snapshot(group, keys)
                engine.update_group(i, cfg)
            except ValueError as e:
                # The engine numbers only the groups and parameters it holds: name them as the caller does.
                msg = self._shown_parameters(str(e).removeprefix(f"dion3: group {i}: ").removeprefix("dion3: "))
                if re.match(r"parameter \d+ '[^']*' of group \d+", msg):
                    raise ValueError(f"dion3: {msg}") from None
                raise ValueError(f"dion3: parameter group {gi}: {msg}") from None
            self._pushed[i] = (keys, snapshot, len(group), cfg)

    def _push_or_refuse(self, engine, replannable: bool = False) -> None:
        """_push_groups; refused (Optimizer::refuse_invalid) so that the other ranks raise too
        instead of waiting for this one. replannable: a setting refused for the parameters the
        engine holds, where the groups' parameters changed since, raises _Replan instead."""
        try:
            self._push_groups(engine)
        except Exception as e:
            if replannable and isinstance(e, ValueError) and engine.stale_for_replay():
                raise _Replan() from None
            if self._mesh is not None:
                engine.refuse_invalid()
            raise

    def _replan(self, key, agreeing: bool = False) -> None:
        """_rebuild at a step. State written or replaced since the old engine last checked it is
        checked by the new engine's first step (Optimizer::state_changed). Refused here on this
        rank alone (tied weights, state of the wrong shape), the step is refused with the old
        engine's plan, which the other ranks step with; agreeing: the caller's all-reduce tells them."""
        old, old_key = self._engine, self._engine_key
        touched = old is not None and (self._state_replaced() or old.state_pending())
        self._before_rebuild()
        try:
            self._rebuild(key)
        except Exception:
            if self._mesh is not None and old is not None and not agreeing:
                old.refuse_invalid()
            if old is not None and self._engine is None:
                # Kept: a refusal at the next try goes through the plan the others step with again.
                self._engine, self._engine_key = old, old_key
            raise
        if touched and self._engine is not None:
            self._engine.state_changed()

    def _replanned(self, key):
        """_replan, and the groups pushed into the new engine; None where no parameter has a
        gradient (nothing to step)."""
        self._replan(key)
        engine = self._engine
        if engine is not None:
            self._push_or_refuse(engine)
        return engine

    def _before_rebuild(self) -> None:
        """Before a rebuild, while the engine still holds the plan the other ranks step with: what
        it would raise first for its last enqueued step (the ranks disagreed on it) is raised now,
        as the others' next step raises it; and a group invalid on this rank alone is refused with
        that plan (Optimizer::refuse_invalid), so that they raise too instead of waiting for this
        rank; then its error is raised here."""
        if self._mesh is None or self._engine is None:
            return
        self._engine.check_last_agreement()
        try:
            self._check_groups()
        except Exception:
            self._engine.refuse_invalid()
            raise

    def _refuse_without_gradients(self, key, dry: bool = False) -> None:
        """No gradient on this rank while the others may step, and no engine to refuse with as it
        is (it must be made anew: a first step, a load, a moved tensor): this rank still joins
        their step's collectives, so that every rank refuses it (Optimizer::refuse_step) instead of
        pairing with this rank's next step. With an engine, it refuses as planned; without one,
        every parameter that requires a gradient is registered for this one refusal (the plan
        the others make when all of theirs have one), with a gradient the refusal never reads,
        and the engine is released after it (the next step builds afresh). dry: registered and
        released, not refused (what would fail, fails)."""
        if not dry:  # no rank stepped: the next step checks first, as after a refusal
            self._agree_first = self._refusals_reach_every_rank()
        if self._engine is not None:
            if not dry:
                self._engine.refuse_step()  # the plan the others hold, unless they changed it too
            return
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        if not params:
            return
        kinds = dict(self._kinds)  # what the next real step judges switches of algorithm by
        try:
            for p in params:
                p.grad = torch.empty_like(p)
            self._rebuild(key)
            if self._engine is not None:
                self._push_groups(self._engine)
                if not dry:
                    self._engine.refuse_step()
        finally:
            for p in params:
                p.grad = None
            self._restore_switched()  # nothing was applied: a switch of algorithm waits as well
            self._kinds = kinds
            self._engine, self._engine_key, self._pushed, self._pushed_to = None, None, {}, None
            self._engine_params, self._engine_states, self._adamw_steps, self._absent = [], [], [], []

    def _run_first(self, engine, asynchronous: bool) -> int:
        """_run_engine, putting back the state a switch of algorithm replaced (_rebuild) when the
        first step after it is refused (ValueError: the ranks' plans or hyper-parameters differ,
        another rank had no gradients or refused the step, or an earlier enqueued step is reported;
        NonFiniteError; nothing was written): that rank's state stays as it was, and
        the next step builds afresh. A step that only enqueues (blocking=False) learns of a
        dropped step later: the fresh state is kept then."""
        if not self._switched_from:
            return self._run_engine(engine, asynchronous)
        try:
            status = self._run_engine(engine, asynchronous)
        except (ValueError, NonFiniteError):
            self._restore_switched()
            raise
        if status >= 0:
            self._switched_from = {}
        return status

    def _restore_switched(self) -> None:
        """The state a switch of algorithm replaced, put back (see _run_first); the engine,
        which holds the fresh state, is made anew at the next step."""
        for p, (old, kind) in self._switched_from.items():
            self.state[p].clear()
            self.state[p].update(old)
            if kind is None:
                self._kinds.pop(p, None)
            else:
                self._kinds[p] = kind
        self._switched_from = {}
        self._dirty = True

    def _run_engine(self, engine, asynchronous: bool) -> int:
        """The engine's step; -1 asks for a rebuild (parameters, groups or storage changed: see step).
        Its errors name state tensors as opt.state[p] does, not by the engine's names."""
        try:
            return self._engine_step(engine, asynchronous)
        except (ValueError, NonFiniteError) as e:
            shown = self._shown_state_names(self._shown_parameters(str(e)))
            if shown == str(e):
                raise
            raise type(e)(shown) from None

    def _shown_parameters(self, message: str) -> str:
        """`message` with each engine-numbered "parameter <k> '<name>'" (and the engine's group
        after it) as the constructor names the parameter: its position in its own group, and that group."""
        where = {id(p): (gi, j) for gi, g in enumerate(self.param_groups) for j, p in enumerate(g["params"])}

        def shown(m):
            k = int(m.group(1))
            if k >= len(self._engine_params) or id(self._engine_params[k]) not in where:
                return m.group(0)
            gi, j = where[id(self._engine_params[k])]
            return f"parameter {j} '{self._param_name(self.param_groups[gi], gi, j)}' of group {gi}"
        return re.sub(r"parameter (\d+) '[^']*'(?: \(group \d+\))?", shown, message)

    def _shown_state_names(self, message: str) -> str:
        """`message` with each "state '<engine name>'" as opt.state[p] names it (exp_avg_sq is an
        AdamW group's 'variance'); a name two kinds of this optimizer's groups show differently is kept."""
        shown: Dict[str, Optional[str]] = {}
        for kind in {self._state_kind(g) for g in self.param_groups}:
            for name, engine_name in _ENGINE_NAMES.get(kind, {}).items():
                shown[engine_name] = name if shown.get(engine_name, name) == name else None
        return re.sub(r"state '(\w+)'", lambda m: f"state '{shown.get(m.group(1)) or m.group(1)}'", message)

    def _engine_step(self, engine, asynchronous: bool) -> int:
        if self._given_grads:
            # DTensor gradients live on the DTensor, not on the local shard the engine holds: hand
            # the engine this step's local gradients. (A channels-last weight's view in memory
            # order has its gradient read from the parameter by the engine itself.)
            if any(p.grad is not None for p in self._unregistered):
                return -1
            grads = [_dist.local_grad(p) for p in self._engine_params]
            return engine.step_async_with(grads) if asynchronous else engine.step_with(grads)
        return engine.step_async() if asynchronous else engine.step()

    def _blocks(self) -> bool:
        """Whether step() waits for the GPU's verdict: blocking=None means yes under
        on_nonfinite='raise' (the error comes from the step that met the bad gradient) and no
        under 'skip' (nothing to report at once)."""
        return self._on_nonfinite == "raise" if self._blocking is None else self._blocking

    def _sync_counters(self, wait: bool = True) -> None:
        """Fold the steps the engine applied or dropped without us seeing them (steps that did
        not wait, replays of a captured CUDA graph) into state[p]["step"] and steps_skipped.
        wait=False: only if the last asynchronous copy of the counters has arrived."""
        if not self._counters_pending and self._bumps is None:
            return
        # Under _state_lock: a reader in another thread would otherwise fold a step's count before
        # the step runs (and the step's own fold then find nothing pending), or fold twice.
        with self._state_lock:
            self._finish_bumps()
            if not self._counters_pending or self._engine is None:
                return
            if self._unfolded:  # a blocking step's count was cut short: the absences it stepped with
                self._absent = self._engine.absent()
            if not wait:
                if getattr(self, "_replayed", False):
                    return  # replays since the last posted verdict: counted from the engine's counters
                posted = self._engine.posted_counters()
                if posted is None:
                    return
                applied, skipped = posted
                if applied + skipped != self._applied_seen + self._skipped_seen:
                    return  # not the verdict of every step counted so far (or replays since)
            else:
                applied, skipped = self._engine.steps_taken, self._engine.steps_skipped
            self._fold_counters(applied, skipped)

    def _fold_counters(self, applied: int, skipped: int) -> None:
        """The engine's counters (steps applied, dropped) into state[p]["step"] and steps_skipped.
        A signal may land at any call or loop: what it would leave half done is either not yet
        committed (the fold runs again) or the new step values, written again by _finish_bumps."""
        delta, dropped = applied - self._applied_seen, skipped - self._skipped_seen
        bumps = [(st, st["step"] + delta) for st in self._counted_states()] if delta else []
        deferred = self._on_nonfinite == "raise" and not self._blocks()  # raised, not skipped
        # Plain stores from here to _finish_bumps (no call a signal could land at).
        self._bumps = bumps
        self._applied_seen, self._skipped_seen = applied, skipped
        if deferred:
            self._raised_pending += dropped
        else:
            self._steps_skipped += dropped
        self._counters_pending = self._unfolded = False
        self._finish_bumps()

    def _finish_bumps(self) -> None:
        """The step counters a fold committed to, written (again: idempotent)."""
        bumps = self._bumps
        if bumps is not None:
            for st, value in bumps:
                st["step"] = value
            self._bumps = None

    def _raise_deferred(self, poll: bool) -> None:
        """Under on_nonfinite='raise' with blocking=False: raise for a step that was dropped."""
        if self._on_nonfinite != "raise" or self._blocks():
            return
        self._sync_counters(wait=not poll)
        if self._raised_pending:
            n, self._raised_pending = self._raised_pending, 0
            raise NonFiniteError(
                f"dion3: {n} earlier step(s) met a non-finite gradient (NaN or Inf) or one that would make the "
                "optimizer state non-finite, and were not applied (nothing written); on_nonfinite='raise' with "
                "blocking=False reports it at the first call after the GPU finished them")

    def check_nonfinite(self) -> None:
        """Wait for the steps enqueued so far and raise NonFiniteError if one of them was dropped
        (on_nonfinite='raise', blocking=False). Other settings: a no-op."""
        self._raise_deferred(poll=False)

    def state_changed(self) -> None:
        """After writing optimizer state in a way PyTorch does not count as an in-place write
        (through ``.data``, a torch.distributed collective into a state tensor, or from outside
        PyTorch): the next step's non-finite check then reads all of it. In-place writes to the
        state tensors (``mul_``, ``copy_``, ...) and load_state_dict need no call: step() notices
        them, and so does refresh_hyperparameters(), which a replay of a captured step needs
        anyway."""
        if self._engine is not None:
            self._engine.state_changed()

    def refresh_hyperparameters(self) -> None:
        """Before replaying a step you captured yourself (torch.cuda.graph around opt.step(), or a
        whole training step): write the groups' current lr, weight decay, momentum, betas and
        epsilon where the captured kernels read them, and have the next check read state tensors
        written in place since (see state_changed). RuntimeError when something the captured
        step cannot follow changed (parameters, groups, fraction, blocks, nesterov, cautious_wd,
        selection_scope, orthogonalizer, a loaded state: anything that made the optimizer build
        its engine anew since the capture): capture again."""
        engine = self._engine
        # DTensor gradients: this step's local shards, where no collective is needed to place them
        # (a Partial one is compared by the replay's own redistribution, not here).
        given = [_dist.placed_local_grad(p) for p in self._engine_params] if self._given_grads else None
        if (engine is None or self._stale(self._registration_key()) or engine.stale_for_replay()
                or self._captured_generation not in (None, self._engine_generation)
                or engine.grads_replaced(given) or self._absence_changed(engine)):
            raise RuntimeError("dion3: the optimizer's parameters, groups, state tensors, the parameters with a "
                               "gradient or their .grad tensors changed since the capture; capture again")
        self._push_groups(engine)
        try:
            engine.refresh_hyperparameters()
        except ValueError as e:
            raise RuntimeError(str(e)) from None
        self._counters_pending = True
        self._replayed = True

    @_under_state_lock
    def state_dict(self) -> Dict[str, Any]:
        """torch's state_dict in the reference package's layout, so that its optimizers load it
        and ours load theirs: state as _state_shapes names it (with each parameter's own "step"
        besides), and each group with "step" (the most steps any of its parameters took), "beta1"
        and "beta2" (besides "betas"), and "nordion2" for Dion3; "steps_skipped" beside "state" and in
        each group (torch.distributed.checkpoint keeps only state and groups)."""
        self._sync_counters()
        self._raise_deferred(poll=False)
        self._own_state()
        # torch's post-hooks see the dict as it is returned (dion3's layout below), and run once.
        name = "_optimizer_state_dict_post_hooks"
        post = getattr(self, name, None)
        try:
            if post is not None:
                setattr(self, name, type(post)())
            sd = super().state_dict()
        finally:
            if post is not None:
                setattr(self, name, post)
        # A parameter without state (frozen, never stepped) whose entry a read of opt.state[p]
        # made, empty: saved as none, as for one never read.
        sd["state"] = {k: v for k, v in sd["state"].items() if v}
        switched = self._switched_state()
        if switched:  # torch numbers the parameters group by group, in order
            ids = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
            for p, st in switched.items():
                sd["state"][ids[id(p)]] = st
        for g in sd["param_groups"]:  # torch's copies of the groups
            if g.get("algorithm") == "dion3":
                g["algorithm"] = "nordion2"
            if "betas" in g:
                g["beta1"], g["beta2"] = (float(b) for b in g["betas"])
            steps = [sd["state"][i].get("step", 0) for i in g["params"] if i in sd["state"]]
            g["step"] = max(steps, default=0)
            g["steps_skipped"] = self._steps_skipped  # in every group too: DCP keeps only state and groups
        sd["steps_skipped"] = self._steps_skipped  # dion3's own; torch and the reference ignore it
        for hook in list((post or {}).values()):
            result = hook(self, sd)
            if result is not None:
                sd = result
        return sd

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
        """The engine's megabatches (shape, count, selected rows, orthogonalizer, workspace); "group"
        is the index in param_groups (the engine leaves out groups without parameters to step)."""
        if self._engine is None:
            return []
        return [dict(mb, group=self._engine_groups[mb["group"]]) for mb in self._engine.plan()]

    # ---- internals --------------------------------------------------------------------------

    # Other optimizers' names for settings, refused naming this optimizer's (see _check_keys).
    _key_aliases = _KEY_ALIASES
    # Where a 1-D tensor given to a matrix group belongs.
    _vectors_advice = ("put 1-D tensors and scalars in an 'adamw' or 'lion' group (dion3.param_groups(model) makes such groups: "
                       "matrices to {algo}, vectors, embeddings and the head to AdamW)")

    def _state_kind(self, group: Dict[str, Any]) -> str:
        """Which names (_ENGINE_NAMES) the group's state goes by."""
        return _kind(group.get("algorithm"))

    def _engine_group(self, group: Dict[str, Any]) -> Dict[str, Any]:
        """A group under the keys _engine_config reads; this optimizer's groups already are."""
        return group

    def _param_name(self, group: Dict[str, Any], gi: int, j: int) -> str:
        names = group.get("param_names")
        if names is not None and j < len(names):
            return str(names[j])
        return f"group{gi}.param{j}"

    def _check_keys(self, gi: int, group: Dict[str, Any]) -> None:
        """A group key dion3 would silently ignore is refused when it is a likely mistake: a
        misspelt setting (the nearest valid one is named), another optimizer's name for a setting,
        a reference or torch.optim option not implemented here (newton_schulz_func, maximize).
        Keys far from any setting are carried untouched, as torch.optim does (schedulers' keys, a
        user's own tags such as a layer index)."""
        _refuse_unimplemented(gi, group)
        # 'transposed' is no default (groups carry it only where given) but is a setting all the same.
        known = set(self.defaults) | {"params", "param_names", "transposed"}
        for key in group:
            if key in known or key in _SCHEDULER_KEYS or not isinstance(key, str):
                continue
            where = f"dion3: parameter group {gi}"
            target = next((t for t in self._key_aliases.get(key, ()) if t in known), None)
            if target is not None:
                raise ValueError(f"{where}: unknown setting '{key}'; dion3 calls it '{target}'")
            if _is_setting_tag(key, known):
                continue
            near = [k for k in sorted(known - {"params", "param_names"})
                    if isinstance(k, str) and len(key) > 2 and _one_edit_apart(key, k)]
            if near:
                raise ValueError(f"{where}: unknown setting '{key}'; did you mean '{near[0]}'?")

    def _check_groups(self) -> None:
        for gi, group in enumerate(self.param_groups):
            self._check_group(gi, group)

    def _check_group(self, gi: int, group: Dict[str, Any]) -> None:
        """Everything that can be told before a step, so errors come before any change."""
        self._check_keys(gi, group)
        try:
            cfg = _engine_config(self._engine_group(group))
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
            # Autograd cannot train an inference tensor, and torch lets a step write one in place only
            # inside inference_mode; the engine would write its memory anywhere, so it is refused.
            if _dist.local(p).is_inference():
                raise ValueError(f"dion3: {who} is an inference tensor (made under torch.inference_mode()): autograd "
                                 "cannot train it, and PyTorch lets a step write it only inside inference_mode; "
                                 "make the model outside inference_mode (nn.Parameter(w.clone()) made there is a "
                                 "normal tensor)")
            if device is None:
                device = p.device
            elif p.device != device:
                raise ValueError(f"dion3: {who} is on {p.device} but the group's first parameter is on "
                                 f"{device}; one optimizer steps parameters of one device")
            if not p.is_contiguous():
                fmt = _dist.memory_format(p)
                if fmt is None:
                    hint = ("; it is a transposed view: give it storage of its own (nn.Parameter(w.contiguous())), "
                            "or keep the (in, out) tensor contiguous in a group with transposed=True"
                            if p.dim() == 2 and p.t().is_contiguous() else
                            "; give it storage of its own (nn.Parameter(w.contiguous()))")
                    raise ValueError(f"dion3: {who} is not contiguous; dion3 needs contiguous parameters (or "
                                     f"channels-last convolution weights){hint}")
                if matrix and not group["flatten"]:
                    raise ValueError(f"dion3: {who} is laid out {str(fmt).split('.')[-1]}: as a stack of "
                                     "matrices over its last two dimensions (flatten=False) it is not contiguous; "
                                     "give its group flatten=True (one matrix per output channel, stepped in "
                                     "memory order), or model.to(memory_format=torch.contiguous_format)")
            if matrix and p.dim() >= 2 and p.numel() == 0:
                raise ValueError(f"dion3: {who} has shape {list(p.shape)}: no elements to orthogonalize; leave it "
                                 "out, or put it in an 'adamw' or 'lion' group (dion3.param_groups(model) does)")
            if matrix and p.dim() < 2:
                algo = {"muon": "Muon", "normuon": "NorMuon", "dion2": "Dion2"}.get(group["algorithm"], "Dion3")
                raise ValueError(f"dion3: {who} has shape {list(p.shape)} but {algo} needs a matrix; "
                                 + self._vectors_advice.format(algo=algo))
        if matrix and (cfg["split_sizes"] or cfg["num_heads"] > 1):
            # A transposed group's blocks are of output features: stored columns.
            unit = "stored columns" if cfg["transposed"] else "rows"
            for j, p in enumerate(group["params"]):
                if cfg["transposed"] and group["flatten"] and p.dim() > 2:
                    continue  # refused by the engine for what it is (no stored (in, out) orientation)
                rows = (p.shape[-1] if cfg["transposed"] else
                        p.shape[0] if (group["flatten"] or p.dim() == 2) else p.shape[-2])
                split = cfg["split_sizes"]
                if (sum(split) != rows) if split else (rows % cfg["num_heads"] != 0):
                    what = (f"'split_sizes' {list(split)} sum to {sum(split)} {unit}" if split else
                            f"'num_heads' = {cfg['num_heads']} does not divide them into heads of equal size")
                    raise ValueError(f"dion3: parameter {j} '{self._param_name(group, gi, j)}' of group {gi} has "
                                     f"{rows} {unit} per matrix but {what}; put parameters of other sizes in a "
                                     "group of their own")
        # Layouts: every rank sees the same metadata, so every rank raises alike, before any step.
        meshes = []
        for j, p in enumerate(group["params"]):
            who = f"parameter {j} '{self._param_name(group, gi, j)}' of group {gi}"
            _dist.layout_of(p, self._mesh, who, matrix, bool(group["flatten"]))
            if _dist.is_dtensor(p):
                pmesh = _dist.mesh_of(p, self._mesh)
                if not any(_dist.same_mesh(pmesh, m) for m in meshes):
                    meshes.append(pmesh)
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

    def _check_aliasing(self, new_group: Optional[int] = None) -> None:
        """Refuses a tensor that would be updated twice per step: the same parameter twice (in one
        group or two), or parameters whose memory overlaps (views of one storage, tied weights
        given as separate tensors). Tied weights given once are one parameter and fine.
        new_group: check only that group against the others, which were checked when they were
        added (add_param_group stays linear per group); None: all of them afresh."""
        if new_group is None or self._alias_index is None:
            self._alias_index = self._alias_scan([], {}, range(len(self.param_groups)))
            return
        try:  # copies: a refused group leaves the index as it was
            self._alias_index = self._alias_scan(list(self._alias_index[0]), dict(self._alias_index[1]),
                                                 [new_group])
        except ValueError:
            # The index may be stale (a parameter since moved out of its group, a group deleted,
            # storage re-pointed by model.half()): only a scan of the groups as they are now refuses.
            self._alias_index = self._alias_scan([], {}, range(len(self.param_groups)))

    def _alias_scan(self, spans: list, ids: dict, groups) -> Tuple[list, dict]:
        """_check_aliasing's walk over the given groups, adding to spans and ids; raises on the
        first parameter that repeats or overlaps one seen before."""

        def who(gi: int, j: int) -> str:
            return f"parameter {j} '{self._param_name(self.param_groups[gi], gi, j)}' of group {gi}"

        for gi in groups:
            for j, p in enumerate(self.param_groups[gi]["params"]):
                if id(p) in ids:
                    raise ValueError(f"dion3: {who(gi, j)} is the same tensor as {who(*ids[id(p)])}; each "
                                     "parameter may appear once in an optimizer (pass tied weights once)")
                ids[id(p)] = (gi, j)
                t = _dist.local(p)
                if t.device.type == "meta" or t.numel() == 0 or t.data_ptr() == 0:
                    continue  # no memory to share
                span = (str(t.device), t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                # The spans so far are disjoint and sorted: only the two neighbours can overlap.
                k = bisect.bisect_left(spans, span)
                for other in spans[max(k - 1, 0):k + 1]:
                    if other[0] == span[0] and other[1] < span[2] and span[1] < other[2]:
                        raise ValueError(f"dion3: {who(gi, j)} shares memory with {who(other[3], other[4])} "
                                         "(views of one tensor, or the same storage given twice); each would "
                                         "be updated twice per step: optimize the tensor once")
                spans.insert(k, span + (gi, j))
        return spans, ids

    def _own_state(self) -> None:
        """optimizer.state as a _StateMap (torch's load_state_dict, or the caller, may put in a plain
        dict), with state for every parameter that requires a gradient, as from construction on: a
        parameter whose state the caller cleared (opt.state.clear(), a fresh dict) gets it back, zero."""
        if not isinstance(self.state, _StateMap):
            self.state = _StateMap(dict, self.state)
        for g in self.param_groups:
            for p in g["params"]:
                if p.requires_grad and not self.state.get(p):
                    try:
                        st = self._zero_state(g, p)
                    except (ValueError, RuntimeError):
                        continue  # a group the next step refuses (a 1-D tensor appended to a matrix group)
                    self.state[p].update(st)

    def _rebuild(self, key) -> None:
        """Register the parameters that have a gradient with a fresh engine, and the matrices that
        require one but have none now (left alone until they have one, in the same plan: an expert
        without tokens does not make a later step plan again). None at all: no engine."""
        self._sync_counters()
        self._engine = None
        self._engine_key = None
        self._check_aliasing()  # storage may have been re-pointed (p.data = ...) since construction
        self._check_groups()  # before any state is made for what they hold
        # A parameter taken out of every group, its state dropped too, is forgotten: remembered,
        # its tensor would live as long as the optimizer.
        live = {id(p) for g in self.param_groups for p in g["params"]}
        self._kinds = {p: k for p, k in self._kinds.items() if id(p) in live or self.state.get(p)}
        self._own_state()
        registering = []
        for gi, group in enumerate(self.param_groups):
            matrix = group["algorithm"] in MATRIX_ALGORITHMS
            members = [(j, p) for j, p in enumerate(group["params"])
                       if p.grad is not None or (matrix and p.requires_grad)]
            if members:
                registering.append((gi, group, members))
        if not any(p.grad is not None for _, _, members in registering for _, p in members):
            self._engine_key = key
            self._watched_state, self._watched_version = self.state, self.state.version
            self._dirty = False
            return
        gi0, group0, j0, p0 = next((gi, g, j, p) for gi, g, members in registering for j, p in members
                                   if p.grad is not None)
        device = p0.device
        if device.type not in ("cpu", "cuda"):
            where = "materialise them first (to_empty)" if device.type == "meta" else "move the model"
            raise ValueError(f"dion3: parameter {j0} '{self._param_name(group0, gi0, j0)}' of group {gi0} is on "
                             f"'{device}'; dion3 runs on cpu and cuda ({where})")
        # Names the caller gave (param_names: the model's) join the ranks' agreement on the plan;
        # positional ones would refuse ranks whose parameters without gradients differ.
        named = all("param_names" in group for group in self.param_groups)
        engine = _C.Engine(device.type, device.index or 0, self._on_nonfinite, self._workspace_limit,
                           getattr(self, "_megabatch", True), getattr(self, "_record_orthogonalizer", True),
                           named)
        # The engine needs unique names; torch takes a module's local names ('weight') in several
        # groups: a repeated one is qualified by its group (and position).
        given = {(gi, j): self._param_name(g, gi, j) for gi, g in enumerate(self.param_groups)
                 for j in range(len(g["params"]))}
        seen = collections.Counter(given.values())

        def engine_name(group, gi, j):
            name = given[gi, j]
            return name if seen[name] == 1 else f"group{gi}.{j}.{name}"
        new_state: Dict[torch.Tensor, Dict[str, Any]] = {}
        kinds: Dict[torch.Tensor, str] = {}
        switched = set()
        engine_params, engine_groups, steps, adamw_check = [], [], [], []
        given_grads = False
        for gi, group, members in registering:
            ei = engine.add_group(_engine_config(self._engine_group(group)))
            engine_groups.append(gi)
            matrix = group["algorithm"] in MATRIX_ALGORITHMS
            kind, state_kind = _kind(group["algorithm"]), self._state_kind(group)
            for j, p in members:
                name_j = engine_name(group, gi, j)
                old = self.state.get(p, {})
                if self._kinds.get(p, kind) != kind:
                    old = {}  # another kind of algorithm: its moments mean something else
                    switched.add(p)
                kinds[p] = kind
                st = _state_tensors(group, p, old, state_kind, f"parameter '{name_j}'")
                _check_restructured(group, p, st, f"parameter '{name_j}'", state_kind)
                absent = p.grad is None
                if not absent and p.grad.device != p.device:
                    raise ValueError(f"dion3: parameter '{name_j}' is on "
                                     f"{p.device} but its gradient is on {p.grad.device}")
                layout = _dist.layout_of(p, self._mesh, f"parameter '{name_j}'", matrix, bool(group["flatten"]))
                is_dt = _dist.is_dtensor(p)
                order = _dist.memory_order(p)  # a channels-last weight: stepped in memory order
                given_grads |= is_dt
                weight, grad = _dist.local(p), _dist.registration_grad(p) if is_dt and not absent else None
                if order is not None:
                    # Detached: a view of the parameter itself would reference its tensor, which
                    # torch.utils.swap_tensors (model.to() in swap mode) then refuses to swap.
                    weight, grad = p.detach().permute(order), None if absent else p.grad.permute(order)
                engine.add_param(ei, name_j, weight, _engine_state(group, st, order, state_kind),
                                 layout.kind, layout.group, layout.global_rows, layout.global_cols,
                                 layout.row_offset, layout.row_chunk, layout.col_group,
                                 grad, p if weight is not p else None, list(order or ()), absent)
                st["step"] = int(old.get("step", 0))
                new_state[p] = st
                engine_params.append(p)
                steps.append(st["step"])
                adamw_check.append((group, p))
        # A switched group's parameters this step leaves alone (no gradient, frozen with state)
        # start afresh with it too, as a checkpoint taken before the step holds them (_switched_state).
        for group in self.param_groups:
            kind, state_kind = _kind(group["algorithm"]), self._state_kind(group)
            for p in group["params"]:
                if p in new_state or not self._restarts_with_group(p, kind):
                    continue
                try:
                    st = _state_tensors(group, p, {}, state_kind)
                except (ValueError, RuntimeError):
                    continue  # as _switched_state: left to the step that registers it
                new_state[p] = dict(st, step=0)
                kinds[p] = kind
                switched.add(p)
        registered = set(engine_params)
        unregistered = [p for g in self.param_groups for p in g["params"] if p not in registered]
        engine.watch([p for p in unregistered if not _dist.is_dtensor(p)])
        engine.watch_groups([(g, list(g["params"])) for g in self.param_groups])
        # Only AdamW's bias correction reads the engine's per-parameter counters; restoring them
        # costs a host round trip of the state (the engine has no cheaper setter yet), so it is
        # done only when an AdamW parameter resumes.
        applied_seen, skipped_seen = 0, 0
        if any(s and g["algorithm"] == "adamw" for s, (g, _) in zip(steps, adamw_check)):
            engine.set_param_steps(steps, max(steps), self._steps_skipped)
            applied_seen, skipped_seen = max(steps), self._steps_skipped
        # The engine accepted everything: commit the state. What a switch of algorithm replaces is
        # kept until the engine's first step is through (see _run_first).
        for p in switched:  # the state before the first of several switches without a step between
            self._switched_from.setdefault(p, (dict(self.state[p]), self._kinds.get(p)))
        for p, st in new_state.items():
            if p in switched:
                self.state[p].clear()
            self._kinds[p] = kinds[p]
            self.state[p].update(st)
        self._engine = engine
        self._engine_generation += 1
        self._engine_params = engine_params
        self._engine_cuda = device.type == "cuda"
        self._applied_seen, self._skipped_seen = applied_seen, skipped_seen
        self._counters_pending = False
        self._engine_states = [self.state[p] for p in engine_params]
        self._absent = []
        # Each AdamW state's "step" less the steps counted since: what _state_replaced expects.
        self._adamw_steps = [(st, st["step"] - applied_seen) for st, (g, _) in zip(self._engine_states, adamw_check)
                             if g["algorithm"] == "adamw"]
        engine.watch_state([(st, {k: t for k, t in st.items() if isinstance(t, torch.Tensor)})
                            for st in self._engine_states])
        self._watched_state, self._watched_version = self.state, self.state.version
        self._engine_groups = engine_groups
        self._engine_key = key
        self._given_grads = given_grads
        self._unregistered = unregistered if given_grads else []
        self._dirty = False


def _defaults(**kw) -> Dict[str, Any]:
    return kw  # validated per group in _check_group, with the group's index in the message


class Dion3(_EngineOptimizer):
    """Dion3: Muon that orthogonalizes only a fraction of the momentum rows each step, with error
    feedback and NorMuon normalization (algorithm.md §1). Same constructor as the reference
    `dion.Dion3`; extra, explicit arguments: orthogonalizer ('auto'|'standard'|'gram', onto which
    use_gram_newton_schulz maps), scale_lr_by_fraction, on_nonfinite ('raise'|'skip'),
    workspace_limit (bytes of orthogonalization workspace; None = the engine's default),
    megabatch (False: one collective round per matrix instead of per shape group, for benchmarks),
    blocking (CUDA: whether step() waits for the GPU's non-finite verdict; None = only under
    on_nonfinite='raise'; with blocking=False a 'raise' is reported at a later step(),
    state_dict() or check_nonfinite(), the bad step itself never applied; see docs/cuda-graphs.md),
    momentum_dtype, iteration_dtype, coefficients (a list of (a, b, c) steps, or "polar_express",
    the default, "reference" for the reference package's default set, or "you"), restarts and
    cautious_wd (decay only where update and weight agree in sign: unselected rows keep their values).
    use_triton and triton_post_ortho are accepted and ignored: they pick the reference's kernels,
    not the result (the engine has its own). selection_scope defaults to "local" here, "global"
    in the reference (see docs/distributed.md)."""

    _default_algorithm = "dion3"
    _name = "Dion3"

    def __init__(self, params, distributed_mesh=None, lr: float = 0.01, fraction: float = 0.25,
                 mu: float = 0.95, muon_beta2: float = 0.95, betas: Tuple[float, float] = (0.9, 0.95),
                 weight_decay: float = 0.01, epsilon: float = 1e-8, adjust_lr: Optional[str] = "spectral_norm",
                 flatten: bool = False, use_triton: bool = False, use_polar_express: bool = True,
                 use_gram_newton_schulz: bool = False, newton_schulz_func=None,
                 triton_post_ortho: bool = False, selection_scope: str = "local", *, orthogonalizer: str = "auto",
                 scale_lr_by_fraction: bool = False, on_nonfinite: str = "raise",
                 workspace_limit: Optional[int] = None,
                 momentum_dtype: Optional[torch.dtype] = None, iteration_dtype: Optional[torch.dtype] = None,
                 coefficients: Optional[Union[str, Sequence[Tuple[float, float, float]]]] = None,
                 restarts: Optional[Sequence[int]] = None, cautious_wd: bool = False, nesterov: bool = False,
                 megabatch: bool = True, blocking: Optional[bool] = None):
        defaults = _defaults(
            algorithm=self._default_algorithm, lr=lr, fraction=fraction, mu=mu, muon_beta2=muon_beta2,
            betas=tuple(betas), weight_decay=weight_decay, epsilon=epsilon, adjust_lr=adjust_lr,
            flatten=flatten, use_triton=use_triton, triton_post_ortho=triton_post_ortho,
            use_polar_express=use_polar_express,
            use_gram_newton_schulz=use_gram_newton_schulz, newton_schulz_func=newton_schulz_func,
            selection_scope=selection_scope, orthogonalizer=orthogonalizer,
            scale_lr_by_fraction=scale_lr_by_fraction, momentum_dtype=momentum_dtype,
            iteration_dtype=iteration_dtype, coefficients=coefficients, restarts=restarts,
            cautious_wd=cautious_wd, nesterov=nesterov, split_sizes=None, num_heads=None)
        super().__init__(params, distributed_mesh, defaults, on_nonfinite, workspace_limit, megabatch, blocking)


class NorDion2(Dion3):
    """The reference's other name for Dion3 (`dion.NorDion2`): the same optimizer and arguments."""

    _default_algorithm = "nordion2"
    _name = "NorDion2"


class Dion2(_EngineOptimizer):
    """Dion2: Dion3 without the NorMuon normalization — a fraction of the momentum orthogonalized
    per step, with error feedback `ef_decay` (Dion3's `mu`). As in the reference `dion.Dion2`, a
    matrix that no rank cuts selects along its shorter dimension: a tall matrix (more rows than
    columns) selects columns, scored by their l1 norm, k = ceil(fraction * columns); a row-sharded
    (FSDP2) matrix selects rows; column- or block-sharded matrices are refused (use Dion3). Same
    constructor as the reference's, plus Dion3's explicit extra arguments (selection_scope defaults
    to "local" here, as for Dion3); `verbose` is accepted and prints nothing (plan() tells which
    megabatches go by columns). With flatten=True the shorter dimension is that of the (dim0, rest)
    matrix the step works on; the reference looks at the last two dimensions whatever flatten is."""

    _default_algorithm = "dion2"
    _name = "Dion2"

    def __init__(self, params, distributed_mesh=None, lr: float = 0.01, fraction: float = 0.25,
                 ef_decay: float = 0.95, betas: Tuple[float, float] = (0.9, 0.95), weight_decay: float = 0.01,
                 epsilon: float = 1e-8, adjust_lr: Optional[str] = "spectral_norm", flatten: bool = False,
                 use_triton: bool = False, use_polar_express: bool = True, use_gram_newton_schulz: bool = False,
                 newton_schulz_func=None, verbose: bool = False, *, orthogonalizer: str = "auto",
                 selection_scope: str = "local", scale_lr_by_fraction: bool = False, on_nonfinite: str = "raise",
                 workspace_limit: Optional[int] = None,
                 momentum_dtype: Optional[torch.dtype] = None, iteration_dtype: Optional[torch.dtype] = None,
                 coefficients: Optional[Union[str, Sequence[Tuple[float, float, float]]]] = None,
                 restarts: Optional[Sequence[int]] = None, cautious_wd: bool = False,
                 megabatch: bool = True, blocking: Optional[bool] = None):
        defaults = _defaults(
            algorithm=self._default_algorithm, lr=lr, fraction=fraction, ef_decay=ef_decay, muon_beta2=0.95,
            betas=tuple(betas), weight_decay=weight_decay, epsilon=epsilon, adjust_lr=adjust_lr,
            flatten=flatten, use_triton=use_triton, use_polar_express=use_polar_express,
            use_gram_newton_schulz=use_gram_newton_schulz, newton_schulz_func=newton_schulz_func,
            verbose=verbose, selection_scope=selection_scope, orthogonalizer=orthogonalizer,
            scale_lr_by_fraction=scale_lr_by_fraction, momentum_dtype=momentum_dtype,
            iteration_dtype=iteration_dtype, coefficients=coefficients, restarts=restarts,
            cautious_wd=cautious_wd, nesterov=False, split_sizes=None, num_heads=None)
        super().__init__(params, distributed_mesh, defaults, on_nonfinite, workspace_limit, megabatch, blocking)


class NorMuon(_EngineOptimizer):
    """NorMuon: Muon with per-row second-moment normalization (algorithm.md §1 baselines). Same
    constructor as the reference `dion.NorMuon`, plus Dion3's explicit extra arguments and
    ema_momentum (keep the momentum as an average, M = mu*M + (1 - mu)*G, as torch.optim.Muon does;
    the orthogonalized update is the same at a fixed mu). fraction and scale_lr_by_fraction are the
    defaults of groups set to algorithm='dion3'; NorMuon's own groups do not read them."""

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
                 coefficients: Optional[Union[str, Sequence[Tuple[float, float, float]]]] = None,
                 restarts: Optional[Sequence[int]] = None, fraction: float = 0.25,
                 scale_lr_by_fraction: bool = False, megabatch: bool = True, blocking: Optional[bool] = None,
                 ema_momentum: bool = False):
        defaults = _defaults(
            algorithm=self._default_algorithm, lr=lr, fraction=fraction, mu=mu, muon_beta2=muon_beta2,
            betas=tuple(betas), weight_decay=weight_decay, epsilon=epsilon, adjust_lr=adjust_lr,
            flatten=flatten, use_triton=use_triton, use_polar_express=use_polar_express,
            use_gram_newton_schulz=use_gram_newton_schulz, newton_schulz_func=newton_schulz_func,
            selection_scope="local", orthogonalizer=orthogonalizer,
            scale_lr_by_fraction=scale_lr_by_fraction, momentum_dtype=momentum_dtype,
            iteration_dtype=iteration_dtype, coefficients=coefficients, restarts=restarts,
            cautious_wd=cautious_wd, nesterov=nesterov, ema_momentum=ema_momentum, split_sizes=None, num_heads=None)
        super().__init__(params, distributed_mesh, defaults, on_nonfinite, workspace_limit, megabatch, blocking)


class Muon(_EngineOptimizer):
    """Muon: the orthogonalized momentum update (algorithm.md §1 baselines). Same constructor as the
    reference `dion.Muon`, plus Dion3's explicit extra arguments and ema_momentum (as NorMuon's).
    fraction, scale_lr_by_fraction and muon_beta2 are the defaults of groups set to another
    algorithm ('dion3', 'normuon'); Muon's own groups do not read them.
    For torch.optim.Muon's constructor and checkpoints, see dion3.optim.Muon."""

    _default_algorithm = "muon"
    _name = "Muon"

    def __init__(self, params, distributed_mesh=None, lr: float = 0.01, mu: float = 0.95,
                 betas: Tuple[float, float] = (0.9, 0.95), weight_decay: float = 0.01, cautious_wd: bool = False,
                 epsilon: float = 1e-8, nesterov: bool = False, adjust_lr: Optional[str] = "spectral_norm",
                 flatten: bool = False, use_gram_newton_schulz: bool = False, use_triton: bool = False,
                 use_polar_express: bool = True, newton_schulz_func=None, *, orthogonalizer: str = "auto",
                 on_nonfinite: str = "raise", workspace_limit: Optional[int] = None, momentum_dtype: Optional[torch.dtype] = None,
                 iteration_dtype: Optional[torch.dtype] = None,
                 coefficients: Optional[Union[str, Sequence[Tuple[float, float, float]]]] = None,
                 restarts: Optional[Sequence[int]] = None, muon_beta2: float = 0.95, fraction: float = 0.25,
                 scale_lr_by_fraction: bool = False, megabatch: bool = True, blocking: Optional[bool] = None,
                 ema_momentum: bool = False):
        defaults = _defaults(
            algorithm=self._default_algorithm, lr=lr, fraction=fraction, mu=mu, muon_beta2=muon_beta2,
            betas=tuple(betas), weight_decay=weight_decay, epsilon=epsilon, adjust_lr=adjust_lr,
            flatten=flatten, use_triton=use_triton, use_polar_express=use_polar_express,
            use_gram_newton_schulz=use_gram_newton_schulz, newton_schulz_func=newton_schulz_func,
            selection_scope="local", orthogonalizer=orthogonalizer,
            scale_lr_by_fraction=scale_lr_by_fraction, momentum_dtype=momentum_dtype,
            iteration_dtype=iteration_dtype, coefficients=coefficients, restarts=restarts,
            cautious_wd=cautious_wd, nesterov=nesterov, ema_momentum=ema_momentum, split_sizes=None, num_heads=None)
        super().__init__(params, distributed_mesh, defaults, on_nonfinite, workspace_limit, megabatch, blocking)
