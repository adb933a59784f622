# groups.py — dion3.param_groups: the recommended parameter groups of a model.
#
# Matrix weights (>= 2-D) go to the optimizer's matrix algorithm (Dion3 / NorMuon / Muon);
# embeddings, the LM head and every 1-D tensor (biases, norms) go to an element-wise algorithm
# (AdamW by default). Shape alone cannot tell an LM head or an embedding table from a weight
# matrix, so nn.Embedding modules and parameters whose name contains "lm_head" are recognised,
# and both can be named explicitly; `overrides` sets any group option for parameters by name.
from __future__ import annotations

import fnmatch
from typing import Any, Dict, Iterable, List, Optional, Union

import torch
from torch import nn

_Selector = Union[None, str, nn.Module, torch.Tensor, Iterable[Union[str, nn.Module, torch.Tensor]]]


def _ids_of(model: nn.Module, selector: _Selector, names: Dict[int, str]) -> Optional[set]:
    """Parameter ids named by a selector: a module, a parameter, a name or glob, or a list."""
    if selector is None:
        return None
    items = [selector] if isinstance(selector, (str, nn.Module, torch.Tensor)) else list(selector)
    out = set()
    for item in items:
        if isinstance(item, nn.Module):
            out.update(id(p) for p in item.parameters())
        elif isinstance(item, torch.Tensor):
            out.add(id(item))
        elif isinstance(item, str):
            hits = [pid for pid, name in names.items()
                    if name == item or name.startswith(item + ".") or fnmatch.fnmatchcase(name, item)]
            if not hits:
                raise ValueError(f"dion3.param_groups: no parameter of the model matches {item!r}")
            out.update(hits)
        else:
            raise TypeError(f"dion3.param_groups: cannot select parameters with {type(item).__name__}")
    return out


def param_groups(model: nn.Module, lm_head: _Selector = None, embeddings: _Selector = None,
                 overrides: Optional[Dict[str, Dict[str, Any]]] = None, *,
                 elementwise: str = "adamw", elementwise_options: Optional[Dict[str, Any]] = None,
                 ) -> List[Dict[str, Any]]:
    """Build parameter groups for dion3.Dion3 / NorMuon / Muon from a model.

    lm_head, embeddings: a module, a parameter, a parameter name (or module prefix, or glob) or a
        list of them. Defaults: parameters whose name contains "lm_head", and all nn.Embedding
        modules. They go to the element-wise algorithm, as do all tensors with fewer than 2 dims.
    overrides: {name or glob: {group option: value}}, e.g. {"*.router.weight": {"algorithm":
        "adamw", "lr": 3e-4}}; the first matching pattern wins. Parameters with equal options share
        a group.
    elementwise: "adamw" or "lion"; elementwise_options: extra options of those groups (lr, ...).

    Returns a list of dicts for the optimizer; each carries "param_names" (so error messages name
    parameters) and "role" ("matrix", "vector", "embedding", "lm_head"). Frozen parameters are left out.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    names = {id(p): n for n, p in named}
    emb = _ids_of(model, embeddings, names)
    if emb is None:
        emb = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    head = _ids_of(model, lm_head, names)
    if head is None:
        head = {id(p) for n, p in named if "lm_head" in n}
    base_el = {"algorithm": elementwise, **(elementwise_options or {})}
    overrides = overrides or {}
    for pattern in overrides:
        if not any(n == pattern or fnmatch.fnmatchcase(n, pattern) for n, _ in named):
            raise ValueError(f"dion3.param_groups: override {pattern!r} matches no parameter of the model")

    groups: Dict[Any, Dict[str, Any]] = {}
    for name, p in named:
        if id(p) in head:
            role, opts = "lm_head", dict(base_el)
        elif id(p) in emb:
            role, opts = "embedding", dict(base_el)
        elif p.dim() < 2:
            role, opts = "vector", dict(base_el)
        else:
            role, opts = "matrix", {}
        for pattern, extra in overrides.items():
            if name == pattern or fnmatch.fnmatchcase(name, pattern):
                opts.update(extra)
                break
        key = (role, tuple(sorted((k, repr(v)) for k, v in opts.items())))
        g = groups.setdefault(key, {"params": [], "param_names": [], "role": role, **opts})
        g["params"].append(p)
        g["param_names"].append(name)
    return list(groups.values())
