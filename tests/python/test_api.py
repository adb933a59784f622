# test_api.py — the constructor surface of SPEC.md §4: the reference's argument names, order and
# defaults, so that moving from `dion` is an import change.
import inspect

import pytest
import torch

import dion3

SPEC = {
    dion3.Dion3: [("distributed_mesh", None), ("lr", 0.01), ("fraction", 0.25), ("mu", 0.95),
                  ("muon_beta2", 0.95), ("betas", (0.9, 0.95)), ("weight_decay", 0.01), ("epsilon", 1e-8),
                  ("adjust_lr", "spectral_norm"), ("flatten", False), ("use_triton", False),
                  ("use_polar_express", True), ("use_gram_newton_schulz", False), ("newton_schulz_func", None),
                  ("selection_scope", "local")],
    dion3.NorMuon: [("distributed_mesh", None), ("lr", 0.01), ("mu", 0.95), ("muon_beta2", 0.95),
                    ("betas", (0.9, 0.95)), ("weight_decay", 0.01), ("cautious_wd", False), ("epsilon", 1e-8),
                    ("nesterov", False), ("adjust_lr", "spectral_norm"), ("flatten", False),
                    ("use_gram_newton_schulz", False), ("use_triton", False), ("use_polar_express", True),
                    ("newton_schulz_func", None)],
    dion3.Muon: [("distributed_mesh", None), ("lr", 0.01), ("mu", 0.95), ("betas", (0.9, 0.95)),
                 ("weight_decay", 0.01), ("cautious_wd", False), ("epsilon", 1e-8), ("nesterov", False),
                 ("adjust_lr", "spectral_norm"), ("flatten", False), ("use_gram_newton_schulz", False),
                 ("use_triton", False), ("use_polar_express", True), ("newton_schulz_func", None)],
}


@pytest.mark.parametrize("cls", list(SPEC))
def test_positional_signature_matches_reference(cls):
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    positional = [p for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional[0].name == "params"
    assert [(p.name, p.default) for p in positional[1:]] == SPEC[cls]
    extra = {p.name for p in params if p.kind == p.KEYWORD_ONLY}
    assert {"orthogonalizer", "on_nonfinite", "workspace_limit"} <= extra


@pytest.mark.parametrize("cls", list(SPEC))
def test_defaults_land_in_param_groups(cls):
    p = torch.nn.Parameter(torch.randn(4, 4))
    opt = cls([p])
    g = opt.param_groups[0]
    assert g["algorithm"] == {dion3.Dion3: "dion3", dion3.NorMuon: "normuon", dion3.Muon: "muon"}[cls]
    for name, default in SPEC[cls][1:]:
        assert g[name] == default, name
    assert g["orthogonalizer"] == "auto"


def test_positional_call_like_the_reference():
    p = torch.nn.Parameter(torch.randn(8, 4))
    opt = dion3.Dion3([p], None, 0.02, 0.5)
    assert opt.param_groups[0]["lr"] == 0.02 and opt.param_groups[0]["fraction"] == 0.5
