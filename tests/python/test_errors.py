# test_errors.py — every error path of the Python front end: each raises a clear error naming
# what is wrong, and nothing (weights, state, groups) is changed by a call that fails.
import pytest
import torch
from torch import nn

import dion3


def mat(device, *shape, dtype=torch.float32):
    return nn.Parameter(torch.randn(shape or (8, 4), device=device, dtype=dtype))


@pytest.mark.parametrize("cls", [dion3.Dion3, dion3.NorMuon, dion3.Muon])
def test_1d_param_in_matrix_group(device, cls):
    with pytest.raises(ValueError, match=r"has shape \[8\] but .* needs a matrix; put 1-D tensors in an 'adamw'"):
        cls([mat(device), nn.Parameter(torch.randn(8, device=device))])


def test_1d_param_named_in_error(device):
    model = nn.Linear(4, 4).to(device)
    groups = [dict(params=list(model.parameters()), param_names=["lin.weight", "lin.bias"])]
    with pytest.raises(ValueError, match="'lin.bias'"):
        dion3.Dion3(groups)


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5, float("nan")])
def test_fraction_out_of_range(device, fraction):
    with pytest.raises(ValueError, match=r"'fraction' must lie in \(0, 1\]"):
        dion3.Dion3([mat(device)], fraction=fraction)


@pytest.mark.parametrize("field,value,pattern", [
    ("lr", -1e-3, "'lr' must be a finite number >= 0"),
    ("weight_decay", -0.1, "'weight_decay' must be"),
    ("mu", 1.0, r"'mu' must lie in \[0, 1\)"),
    ("muon_beta2", -0.5, "'muon_beta2' must lie"),
    ("epsilon", 0.0, "'epsilon' must be > 0"),
    ("adjust_lr", "spectral", "'adjust_lr' must be"),
    ("orthogonalizer", "svd", "'orthogonalizer' must be 'auto', 'standard' or 'gram'"),
    ("selection_scope", "world", "'selection_scope' must be 'local' or 'global'"),
    ("on_nonfinite", "ignore", "'on_nonfinite' must be 'raise' or 'skip'"),
    ("coefficients", [(1.0, 2.0)], r"\(a, b, c\) triples"),
    ("restarts", [7], "'restarts' positions must lie"),
    ("workspace_limit", -5, "'workspace_limit' must be a byte count"),
])
def test_bad_hyper_parameters(device, field, value, pattern):
    with pytest.raises(ValueError, match=pattern):
        dion3.Dion3([mat(device)], **{field: value})


def test_bad_betas_for_elementwise_group(device):
    with pytest.raises(ValueError, match=r"parameter group 0: 'betas\[1\]' must lie"):
        dion3.Dion3([dict(params=[mat(device)], algorithm="adamw", betas=(0.9, 1.5))])


def test_bad_algorithm(device):
    with pytest.raises(ValueError, match="'algorithm' must be one of"):
        dion3.Dion3([dict(params=[mat(device)], algorithm="sgd")])


def test_negative_lr_set_later_fails_at_step_without_change(device):
    p = mat(device)
    opt = dion3.Dion3([p])
    p.grad = torch.randn_like(p)
    opt.step()
    w = p.detach().clone()
    st = {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
    opt.param_groups[0]["lr"] = -0.1
    with pytest.raises(ValueError, match="'lr' must be a finite number >= 0, got -0.1"):
        opt.step()
    assert torch.equal(p, w) and opt.state[p]["step"] == 1
    assert all(torch.equal(opt.state[p][k], v) for k, v in st.items())
    opt.param_groups[0]["lr"] = 0.01
    opt.step()
    assert opt.state[p]["step"] == 2


def test_bad_add_param_group_is_not_added(device):
    opt = dion3.Dion3([mat(device)])
    with pytest.raises(ValueError, match="needs a matrix"):
        opt.add_param_group(dict(params=[nn.Parameter(torch.randn(3, device=device))]))
    assert len(opt.param_groups) == 1


def test_distributed_mesh_of_the_wrong_type(device):
    with pytest.raises(TypeError, match="distributed_mesh.*ProcessGroup.*DeviceMesh"):
        dion3.Dion3([mat(device)], distributed_mesh=object())


def test_newton_schulz_func_not_supported(device):
    with pytest.raises(NotImplementedError, match="newton_schulz_func"):
        dion3.Muon([mat(device)], newton_schulz_func=lambda x: x)


def test_reference_flags_accepted(device):
    opt = dion3.Dion3([mat(device, 8, 64)], use_triton=True, use_gram_newton_schulz=True, use_polar_express=False)
    p = opt.param_groups[0]["params"][0]
    p.grad = torch.randn_like(p)
    opt.step()
    assert opt.plan()[0]["method"] == "gram"


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32])
def test_unsupported_dtype(device, dtype):
    t = torch.ones(8, 4, device=device, dtype=dtype)
    p = nn.Parameter(t, requires_grad=dtype.is_floating_point)
    with pytest.raises(ValueError, match=f"dtype {str(dtype).replace('torch.', '')} but dion3 supports float32"):
        dion3.Dion3([p])


def test_mixed_dtypes_in_a_group_are_supported(device):
    # fp32 and bf16 weights may share a group (they form separate megabatches); each matches its
    # own single-dtype run.
    a32, b16 = mat(device, 8, 4), mat(device, 8, 4, dtype=torch.bfloat16)
    c32, d16 = nn.Parameter(a32.detach().clone()), nn.Parameter(b16.detach().clone())
    mixed = dion3.Dion3([a32, b16])
    alone = [dion3.Dion3([c32]), dion3.Dion3([d16])]
    for p, q in ((a32, c32), (b16, d16)):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    mixed.step()
    for o in alone:
        o.step()
    assert torch.equal(a32, c32) and torch.equal(b16, d16)
    assert len(mixed.plan()) == 2


def test_mixed_devices_in_a_group():
    cpu = nn.Parameter(torch.randn(8, 4))
    other = nn.Parameter(torch.randn(8, 4, device="meta"))
    with pytest.raises(ValueError, match="is on meta but the group's first parameter is on cpu"):
        dion3.Dion3([cpu, other])


def test_mixed_devices_across_groups():
    cpu = nn.Parameter(torch.randn(8, 4))
    other = nn.Parameter(torch.randn(8, 4, device="meta"))
    with pytest.raises(ValueError, match="one optimizer steps parameters of one device"):
        dion3.Dion3([dict(params=[cpu]), dict(params=[other])])


def test_unsupported_device():
    p = nn.Parameter(torch.randn(8, 4, device="meta"))
    opt = dion3.Dion3([p])
    p.grad = torch.randn(8, 4, device="meta")
    with pytest.raises(ValueError, match="dion3 runs on cpu and cuda"):
        opt.step()


def test_non_contiguous_param(device):
    p = nn.Parameter(torch.randn(4, 8, device=device).t())
    with pytest.raises(ValueError, match="not contiguous"):
        dion3.Dion3([p])


def test_non_contiguous_grad_is_accepted(device):
    # torch itself refuses gradients of another shape, dtype or device; a strided one is legal.
    p, q = mat(device), None
    q = nn.Parameter(p.detach().clone())
    a, b = dion3.Dion3([p]), dion3.Dion3([q])
    g = torch.randn(4, 8, device=device)
    p.grad = g.t()
    q.grad = g.t().contiguous()
    a.step()
    b.step()
    assert not p.grad.is_contiguous() and torch.equal(p, q)


def test_state_of_wrong_shape_is_refused_without_change(device):
    p = mat(device)
    opt = dion3.Dion3([p])
    opt.state[p]["momentum"] = torch.zeros(3, 3, device=device)
    p.grad = torch.randn_like(p)
    w = p.detach().clone()
    with pytest.raises(ValueError, match="state 'momentum' must be float32 \\[8, 4\\]"):
        opt.step()
    assert torch.equal(p, w)


def poisoned(device, bad):
    ps = [mat(device), mat(device, 6, 6), nn.Parameter(torch.randn(5, device=device))]
    return ps, [torch.randn_like(p) for p in ps]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_grad_raise_leaves_everything_unchanged(device, bad):
    ps, gs = poisoned(device, bad)
    opt = dion3.Dion3([dict(params=ps[:2]), dict(params=ps[2:], algorithm="adamw")])
    for p, g in zip(ps, gs):
        p.grad = g
    opt.step()
    before = [p.detach().clone() for p in ps]
    state = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()} for p in ps]
    gs[1][2, 3] = bad
    with pytest.raises(dion3.NonFiniteError, match="'group0.param1' has a non-finite gradient"):
        opt.step()
    with pytest.raises(FloatingPointError):
        opt.step()
    for p, w, st in zip(ps, before, state):
        assert torch.equal(p, w)
        for k, v in st.items():
            assert torch.equal(opt.state[p][k], v) if torch.is_tensor(v) else opt.state[p][k] == v
    gs[1][2, 3] = 0.0
    opt.step()
    assert all(opt.state[p]["step"] == 2 for p in ps)


def test_nonfinite_grad_skip_leaves_everything_unchanged(device):
    ps, gs = poisoned(device, float("nan"))
    opt = dion3.Dion3([dict(params=ps[:2]), dict(params=ps[2:], algorithm="lion")], on_nonfinite="skip")
    for p, g in zip(ps, gs):
        p.grad = g
    opt.step()
    before = [p.detach().clone() for p in ps]
    state = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()} for p in ps]
    gs[2][0] = float("-inf")
    opt.step()  # dropped, no exception
    assert opt.steps_skipped == 1
    for p, w, st in zip(ps, before, state):
        assert torch.equal(p, w)
        for k, v in st.items():
            assert torch.equal(opt.state[p][k], v) if torch.is_tensor(v) else opt.state[p][k] == v
    gs[2][0] = 1.0
    opt.step()
    assert all(opt.state[p]["step"] == 2 for p in ps) and opt.steps_skipped == 1


def test_cuda_tensors_without_cuda_build():
    if not torch.cuda.is_available() or dion3.cuda_built():
        pytest.skip("needs a GPU and a CPU-only build")
    p = nn.Parameter(torch.randn(8, 4, device="cuda"))
    opt = dion3.Dion3([p])
    p.grad = torch.randn_like(p)
    with pytest.raises(NotImplementedError, match="no CUDA backend"):
        opt.step()
