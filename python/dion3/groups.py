# groups.py — dion3.param_groups: the recommended parameter groups of a model.
#
# Matrix weights (>= 2-D) go to the optimizer's matrix algorithm (Dion3 / NorMuon / Muon);
# embeddings, the LM head and every 1-D tensor (biases, norms) go to an element-wise algorithm
# (AdamW by default), and the head learns at lr / sqrt(d_in), as the reference recommends. Shape
# alone cannot tell an LM head or an embedding table from a weight matrix, so they are recognised
# by explicit rules (see param_groups) and can be named; `overrides` sets any group option by name.
from __future__ import annotations

import fnmatch
import math
import warnings
from typing import Any, Dict, Iterable, List, Optional, Union

import torch
from torch import nn

_Selector = Union[None, str, nn.Module, torch.Tensor, Iterable[Union[str, nn.Module, torch.Tensor]]]


def _ids_of(model: nn.Module, selector: _Selector, names: Dict[int, str]) -> Optional[set]:
    """Parameter ids named by a selector: a module, a parameter, a name or glob, or a list."""
    if selector is None:
        return None
    if isinstance(selector, (str, nn.Module, torch.Tensor)):
        items = [selector]
    else:
        try:
            items = list(selector)
        except TypeError:
            raise TypeError(f"dion3.param_groups: cannot select parameters with {type(selector).__name__}") from None
    out = set()
    for item in items:
        if isinstance(item, (nn.Module, torch.Tensor)):
            # One of the model's own: a copy, or one kept from before to_empty() or fully_shard
            # (which make new parameters), would select nothing without a word.
            ids = {id(p) for p in item.parameters()} if isinstance(item, nn.Module) else {id(item)}
            if not ids:
                raise ValueError(f"dion3.param_groups: the {type(item).__name__} given as a selector has no "
                                 "parameters")
            if not ids <= names.keys():
                raise ValueError(f"dion3.param_groups: a {type(item).__name__} given as a selector is not (all) "
                                 "of the model's parameters; pass the model's own module or parameter, or its name")
            out.update(ids)
        elif isinstance(item, str):
            if not item:  # the root module's path: every parameter, surely not what was meant
                raise ValueError("dion3.param_groups: an empty name selects no module or parameter")
            hits = [pid for pid, name in names.items()
                    if name == item or name.startswith(item + ".") or fnmatch.fnmatchcase(name, item)]
            if not hits:
                # A module or parameter listed under another name: a head tied to the embedding
                # appears once, as the embedding's.
                module = _submodule(model, item)
                hits = [id(p) for p in module.parameters()] if module is not None else []
                if not hits:
                    try:
                        hits = [id(model.get_parameter(item))]
                    except AttributeError:
                        pass
            if not hits:
                raise ValueError(f"dion3.param_groups: no parameter or module of the model matches {item!r}")
            out.update(hits)
        else:
            raise TypeError(f"dion3.param_groups: cannot select parameters with {type(item).__name__}")
    return out


def _submodule(model: nn.Module, path: str) -> Optional[nn.Module]:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _stored_in_out(modules: Dict[str, nn.Module]) -> Dict[int, str]:
    """The weights Hugging Face stores (in, out) and uses as x @ W, by id: Conv1D's (GPT-2; its
    class, or a wrapper's made from it: fully_shard's FSDPConv1D), and the expert stacks
    [E, in, out] of modules that say so (the experts implementation's is_transposed: gpt-oss,
    Aria) or Llama 4's."""
    out = {}
    for path, m in modules.items():
        classes = {c.__name__ for c in type(m).__mro__}
        prefix = f"{path}." if path else ""
        # m.weight is read only here: on a parametrized module reading it computes it.
        weight = getattr(m, "weight", None) if "Conv1D" in classes and hasattr(m, "nf") else None
        if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[1] == m.nf:
            out[id(weight)] = f"{prefix}weight"
        elif getattr(m, "is_transposed", False) is True or "Llama4TextExperts" in classes:
            out.update({id(p): f"{prefix}{n}" for n, p in m.named_parameters(recurse=False) if p.dim() >= 3})
    return out


def _cut_by_inputs_at_most(p: torch.Tensor) -> bool:
    """An (in, out) weight whole on each rank, or cut along its first dimension over one mesh
    dimension (FSDP2's Shard(0): a matrix's input features, a stack's experts): the cuts a
    transposed group takes."""
    shards = [pl for pl in getattr(p, "placements", ()) if pl.is_shard()]
    return not shards or (len(shards) == 1 and type(shards[0]).__name__ == "Shard" and shards[0].dim == 0)


def _is_bias_name(name: str) -> bool:
    """A bias table held as one parameter per layer (an MoE's [E, out] per-expert biases, a
    relative position bias table): element-wise, whatever its shape."""
    return "bias" in name.rpartition(".")[2]


def _is_bare_embedding(name: str, modules: Dict[str, nn.Module]) -> bool:
    """A table held as a bare Parameter whose name, or its module's, says it is one (a ViT's
    pos_embed, TransformerLens's embed.W_E): not a Linear's or a convolution's weight, nor an
    unembedding."""
    owner, _, leaf = name.rpartition(".")
    parts = (owner.rpartition(".")[2], leaf)
    return (any("embed" in part and "unembed" not in part for part in parts)
            and not isinstance(modules.get(owner), (nn.Linear, *_CONVOLUTIONS)))


# The LM head by name, where the caller does not name it: a module called lm_head or embed_out
# anywhere (Hugging Face, GPT-NeoX), or a top-level module called head or output (timm, Llama's
# reference code). Deeper "output" / "head" modules are hidden layers (BERT's attention.output).
_HEAD_ANYWHERE = ("lm_head", "embed_out")
_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_MATRIX_BLOCK_KEYS = ("split_sizes", "num_heads")
_HEAD_TOP_LEVEL = ("head", "output", "classifier")


# Wrappers whose parameters appear under one more prefix: torch.compile's _orig_mod, DDP's and
# AveragedModel's module. The model's top level lies below them.
_WRAPPER_PREFIXES = ("_orig_mod", "module")


def _module_path(name: str) -> str:
    """The path of the module a parameter belongs to; a parametrized weight's (weight_norm,
    spectral_norm: module.parametrizations.weight.original0) is the module's."""
    parts = name.split(".")[:-1]
    if "parametrizations" in parts:
        parts = parts[:parts.index("parametrizations")]
    return ".".join(parts)


def _is_head_name(name: str) -> bool:
    path = _module_path(name)
    parts = path.split(".") if path else []
    while len(parts) > 1 and parts[0] in _WRAPPER_PREFIXES:
        parts = parts[1:]
    return bool(parts) and (parts[-1] in _HEAD_ANYWHERE or (len(parts) == 1 and parts[0] in _HEAD_TOP_LEVEL))


def param_groups(model: nn.Module, lm_head: _Selector = None, embeddings: _Selector = None,
                 overrides: Optional[Dict[str, Dict[str, Any]]] = None, *,
                 lr: Optional[float] = None,
                 elementwise: str = "adamw", elementwise_options: Optional[Dict[str, Any]] = None,
                 include_frozen: bool = False) -> List[Dict[str, Any]]:
    """Build parameter groups for dion3.Dion3 / NorMuon / Muon from a model.

    lm_head, embeddings: a module, a parameter, a parameter name (or module prefix, or glob) or a
        list of them (a name may also be a module's path: a head tied to the embedding). Defaults:
        the head is the weight (and bias) of a module named lm_head or embed_out anywhere, or of a
        top-level module named head, output or classifier (below a wrapper's _orig_mod or module);
        embeddings are all nn.Embedding and nn.EmbeddingBag modules and the bare Parameters whose
        name's last part, or their module's, contains "embed" but not "unembed" (a ViT's
        pos_embed, TransformerLens's embed.W_E); embeddings= adds to them (overrides can give
        an nn.Embedding another algorithm). A head tied to an embedding (one Parameter used by
        both) is an embedding, unless lm_head= names it. They go to the element-wise
        algorithm, as do all tensors with fewer than 2 dimensions larger than 1 (biases, norms, a
        (1, 1, d) class token, weight_norm's gains) and every parameter whose name (its last
        part) contains "bias" (an MoE's [E, out] per-expert biases, a relative position bias table).
        Convolution weights (torch.nn's Conv and ConvTranspose modules) get a matrix group of their
        own with flatten=True: one (dim0, rest) matrix each (dim0: a Conv's output channels, a
        ConvTranspose's input channels); other weights of three or more
        dimensions (expert stacks) stay stacks of matrices (flatten=False). Hugging Face Conv1D
        weights (GPT-2's) and the expert stacks of gpt-oss, Aria and Llama 4, stored (in, out),
        get a matrix group with transposed=True (one cut otherwise than FSDP2's Shard(0), by
        tensor parallelism, stays as stored, with a warning).
    lr: the optimizer's base learning rate. Given, each head learns at lr / sqrt(d_in) (d_in: its
        weight's input dimension), the reference's recommendation; every other group keeps
        the optimizer's lr. An lr in elementwise_options is the head's too, as given (not scaled).
        Neither given while a head exists: a warning, and the head learns at the optimizer's lr.
    overrides: {name or glob: {group option: value}}, e.g. {"*.router.weight": {"algorithm":
        "adamw", "lr": 3e-4}}; the first matching pattern wins. Parameters with equal options share
        a group.
    elementwise: "adamw" or "lion"; elementwise_options: extra options of those groups (lr, ...).

    include_frozen: whether parameters with requires_grad=False join the groups. Left out by default
        (a frozen base model, quantized weights included, stays outside the optimizer); included,
        a layer unfrozen later trains from then on (its state is made at its first step).

    Returns a list of dicts for the optimizer; each carries "param_names" (so error messages name
    parameters) and "role" ("matrix", "vector", "embedding", "lm_head").
    """
    every = list(model.named_parameters())
    named = [(n, p) for n, p in every if p.requires_grad or include_frozen]
    # Selectors and overrides may name frozen parameters too (a frozen head): they are matched
    # against every name, and select nothing that is left out.
    names = {id(p): n for n, p in every}
    modules = dict(model.named_modules())
    emb = {id(p) for m in modules.values() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) for p in m.parameters()}
    emb |= {id(p) for n, p in every if _is_bare_embedding(n, modules)}
    emb |= _ids_of(model, embeddings, names) or set()
    head = _ids_of(model, lm_head, names)
    if head is None:
        head = {id(p) for n, p in every if _is_head_name(n)}  # frozen ones too: see head_din
        # A weight tied to an embedding appears once, under its first name: it stays an embedding.
        head -= emb
    # The convolutions' parameters as registered: a parametrized weight (weight_norm, spectral_norm)
    # is its originals, and reading m.weight would compute it (a power iteration, for spectral_norm).
    conv = {id(p) for m in modules.values() if isinstance(m, _CONVOLUTIONS) for p in m.parameters()}
    if elementwise not in ("adamw", "lion"):
        raise ValueError(f"dion3.param_groups: elementwise must be 'adamw' or 'lion', got {elementwise!r}")
    reserved = sorted({"params", "param_names", "role"} & set(elementwise_options or {}))
    if reserved:
        raise ValueError(f"dion3.param_groups: elementwise_options may not set {', '.join(reserved)} "
                         "(param_groups fills them in)")
    base_el = {"algorithm": elementwise, **(elementwise_options or {})}
    overrides = overrides or {}
    if not isinstance(overrides, dict) or not all(isinstance(v, dict) for v in overrides.values()):
        raise TypeError("dion3.param_groups: overrides must map name patterns to dicts of group settings, "
                        "e.g. {'*.qkv.weight': {'split_sizes': [d, d, d]}}")
    # A parameter listed under another name (a head tied to the embedding appears once, as the
    # embedding's) may be named by that name too, as selectors may.
    aliases: Dict[str, int] = {}
    for pattern in overrides:
        if not any(n == pattern or fnmatch.fnmatchcase(n, pattern) for n in names.values()):
            try:
                aliases[pattern] = id(model.get_parameter(pattern))
            except AttributeError:
                raise ValueError(f"dion3.param_groups: override {pattern!r} matches no parameter of the model") \
                    from None

    # Weights stored (in, out) get a group of their own that says so; one cut otherwise than
    # FSDP2's Shard(0) stays as stored (transposed takes no other cut).
    in_out = _stored_in_out(modules)
    transposed = {id(p) for _, p in named if id(p) in in_out and _cut_by_inputs_at_most(p)}
    as_stored = [in_out[id(p)] for _, p in named if id(p) in in_out and id(p) not in transposed]
    if as_stored:
        warnings.warn(f"dion3.param_groups: {len(as_stored)} weights stored (in, out) (Hugging Face's: "
                      f"{', '.join(as_stored[:2])}{', ...' if len(as_stored) > 2 else ''}) are cut otherwise than by "
                      "FSDP2's Shard(0), so they are stepped as stored, with their input features as rows and an "
                      "inverted lr adjustment (docs/parameter-groups.md, 'Rows are output features')", stacklevel=2)
    # Each head's input dimension, by its module (a model may have several heads: its bias learns
    # at its weight's lr, frozen or not); a parametrized weight's widest original (weight_norm's
    # direction, not its (out, 1) gain).
    head_din: Dict[str, int] = {}
    for n, p in every:
        if id(p) in head and p.dim() == 2:
            head_din[_module_path(n)] = max(head_din.get(_module_path(n), 0), p.shape[1])
    if head_din and lr is None and "lr" not in base_el:
        warnings.warn("dion3.param_groups: pass lr= (the optimizer's learning rate) so that the LM head learns "
                      "at lr / sqrt(d_in) as recommended; without it the head uses the optimizer's lr",
                      stacklevel=2)
    groups: Dict[Any, Dict[str, Any]] = {}
    for name, p in named:
        if id(p) in head:
            role, opts = "lm_head", dict(base_el)
            if lr is not None and "lr" not in opts and head_din:
                opts["lr"] = lr / math.sqrt(head_din.get(_module_path(name), max(head_din.values())))
        elif id(p) in emb:
            role, opts = "embedding", dict(base_el)
        elif sum(d > 1 for d in p.shape) < 2 or p.numel() == 0 or _is_bias_name(name):
            # A vector in a matrix's shape ((1, 1, d) tokens, weight_norm's (out, 1) gains), an
            # empty matrix, or a table of biases: nothing to orthogonalize.
            role, opts = "vector", dict(base_el)
        elif id(p) in transposed:
            role, opts = "matrix", {"transposed": True}
        elif id(p) in conv and p.dim() > 2:
            # One (out, in * kernel) matrix per convolution: as a stack of kernel-sized matrices a
            # 1x1 convolution would be signSGD (each 1 x 1 matrix orthogonalizes to its sign).
            role, opts = "matrix", {"flatten": True}
        else:
            role, opts = "matrix", {}
        for pattern, extra in overrides.items():
            if name == pattern or fnmatch.fnmatchcase(name, pattern) or aliases.get(pattern) == id(p):
                if role != "matrix" and "algorithm" not in extra:
                    # A pattern for a fused weight ("*.qkv*") matches its bias too: the blocks of
                    # a matrix mean nothing to an element-wise group, which would refuse them.
                    extra = {k: v for k, v in extra.items() if k not in _MATRIX_BLOCK_KEYS}
                opts.update(extra)
                break
        key = (role, tuple(sorted((k, repr(v)) for k, v in opts.items())))
        g = groups.setdefault(key, {"params": [], "param_names": [], "role": role, **opts})
        g["params"].append(p)
        g["param_names"].append(name)
    return list(groups.values())
