# test_errors.py — every error path of the Python front end: each raises a clear error naming
# what is wrong, and nothing (weights, state, groups) is changed by a call that fails.
import contextlib
import copy
import signal
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import dion3
import dion3.optim


def mat(device, *shape, dtype=torch.float32):
    return nn.Parameter(torch.randn(shape or (8, 4), device=device, dtype=dtype))


@pytest.mark.parametrize("cls", [dion3.Dion3, dion3.NorMuon, dion3.Muon])
def test_1d_param_in_matrix_group(device, cls):
    with pytest.raises(ValueError, match=r"has shape \[8\] but (\w+) needs a matrix; put 1-D tensors and scalars in an 'adamw'"
                                         r".*matrices to \1, vectors"):
        cls([mat(device), nn.Parameter(torch.randn(8, device=device))])
    with pytest.raises(ValueError, match=r"has shape \[\] but \w+ needs a matrix; put 1-D tensors and scalars"):
        cls([nn.Parameter(torch.tensor(1.0, device=device))])


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
    ("coefficients", [(True, False, False)], "'coefficients' must be a number; got the bool True"),
    ("coefficients", [("1.5", "-0.5", "0")], "'coefficients' must be a number; got the string '1.5'"),
    ("restarts", [7], "'restarts' positions must lie"),
    ("workspace_limit", -5, "'workspace_limit' must be a byte count"),
    ("flatten", "False", "'flatten' must be True or False; got 'False'"),
    ("scale_lr_by_fraction", 2, "'scale_lr_by_fraction' must be True or False"),
    ("restarts", [1.5], "'restarts' must hold integers; got 1.5"),
    ("restarts", 2, r"'restarts' must be a list of step positions \(e.g. \[2\]\); got 2"),
    ("use_polar_express", "no", "'use_polar_express' must be True or False; got 'no'"),
])
def test_bad_hyper_parameters(device, field, value, pattern):
    with pytest.raises(ValueError, match=pattern):
        dion3.Dion3([mat(device)], **{field: value})


def test_value_just_past_a_bound_is_printed_as_given(device):
    with pytest.raises(ValueError, match=r"'fraction' must lie in \(0, 1\], got 1.0000001"):
        dion3.Dion3([mat(device)], fraction=1.0000001)


@pytest.mark.parametrize("value", [True, np.True_])
def test_bools_are_not_numbers(device, value):
    with pytest.raises(ValueError, match="'fraction' must be a number; got the bool True"):
        dion3.Dion3([mat(device)], fraction=value)
    p = mat(device)
    p.grad = torch.randn_like(p)
    opt = dion3.Dion3([p])
    opt.param_groups[0]["lr"] = value
    with pytest.raises(ValueError, match="'lr' must be a number; got the bool True"):
        opt.step()


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
    with pytest.raises(NotImplementedError, match="parameter group 0: newton_schulz_func"):
        dion3.Muon([dict(params=[mat(device)], newton_schulz_func=lambda x: x)])
    p = mat(device)
    opt = dion3.Muon([p])
    p.grad = torch.ones_like(p)
    opt.step()
    opt.param_groups[0]["newton_schulz_func"] = lambda x: x  # set between steps
    with pytest.raises(NotImplementedError, match="parameter group 0: newton_schulz_func"):
        opt.step()


@pytest.mark.parametrize("key", ["maximize", "amsgrad"])
def test_torch_options_that_change_the_result_are_refused(device, key):
    # torch.optim options dion3 does not implement are refused when set, in a group given at
    # construction and in one edited between steps; set to False they are carried.
    dion3.Dion3([dict(params=[mat(device)], algorithm="adamw", **{key: False})])
    with pytest.raises(ValueError, match=f"parameter group 0: {key}=True is not implemented"):
        dion3.Dion3([dict(params=[mat(device)], algorithm="adamw", **{key: True})])
    for start in ({}, {key: False}):  # the key added between steps, or set where it was False
        p = mat(device)
        opt = dion3.Dion3([dict(params=[p], algorithm="adamw", **start)])
        p.grad = torch.ones_like(p)
        opt.step()
        w = p.detach().clone()
        opt.param_groups[0][key] = True
        with pytest.raises(ValueError, match=f"{key}=True is not implemented"):
            opt.step()
        assert torch.equal(p, w)
        opt.param_groups[0][key] = False
        opt.step()


def test_a_channels_last_weight_as_a_stack_of_matrices_is_refused_naming_its_layout(device):
    conv = torch.nn.Conv2d(4, 8, 3).to(device).to(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="laid out channels_last: as a stack of matrices .* give its group flatten=True"):
        dion3.Dion3([conv.weight])
    with pytest.raises(ValueError, match="is not contiguous; dion3 needs contiguous parameters.*transposed view: "
                                         r"give it storage of its own .*group with transposed=True"):
        dion3.Dion3([nn.Parameter(torch.randn(6, 8, device=device).t())])
    with pytest.raises(ValueError, match=r"is not contiguous; .*weights\); give it storage of its own"):
        dion3.Dion3([nn.Parameter(torch.randn(6, 8, device=device)[:, ::2])])


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_an_empty_matrix_is_refused_at_construction_and_param_groups_routes_it_elementwise(device):
    model = torch.nn.Sequential(torch.nn.Linear(8, 0), torch.nn.Linear(8, 4)).to(device)
    with pytest.raises(ValueError, match=r"shape \[0, 8\]: no elements to orthogonalize"):
        dion3.Dion3(model.parameters())
    groups = dion3.param_groups(model)
    assert [tuple(p.shape) for g in groups if g["role"] == "matrix" for p in g["params"]] == [(4, 8)]
    opt = dion3.Dion3(groups, lr=0.01)
    x = torch.randn(3, 8, device=device)
    (model[0](x).sum() + model[1](x).sum()).backward()
    opt.step()


def test_reference_flags_accepted(device):
    opt = dion3.Dion3([mat(device, 8, 64)], use_triton=True, use_gram_newton_schulz=True, use_polar_express=False,
                      triton_post_ortho=True)
    p = opt.param_groups[0]["params"][0]
    p.grad = torch.randn_like(p)
    opt.step()
    assert opt.plan()[0]["method"] == "gram"


def test_numpy_bools_are_flags(device):
    np = pytest.importorskip("numpy")
    p = mat(device, 8, 16)
    opt = dion3.Dion3([p], flatten=np.False_, cautious_wd=np.True_)
    assert opt.param_groups[0]["cautious_wd"]
    p.grad = torch.randn_like(p)
    opt.step()
    m = dion3.optim.Muon([mat(device, 8, 16)], nesterov=np.True_)
    m.param_groups[0]["params"][0].grad = torch.ones(8, 16, device=device)
    m.step()



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
    opt = dion3.Dion3([dict(params=[p], param_names=["w"])])
    p.grad = torch.randn(8, 4, device="meta")
    with pytest.raises(ValueError, match=r"parameter 0 'w' of group 0 is on 'meta'; dion3 runs on cpu and cuda "
                                         r"\(materialise them first \(to_empty\)\)"):
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
    with pytest.raises(ValueError, match=r"state 'momentum' has shape \[3, 3\] but the parameter, of shape "
                                         r"\[8, 4\], needs \[8, 4\] .*del optimizer.state\[p\]"):
        opt.step()
    assert torch.equal(p, w)


def test_a_parameter_resized_after_it_stepped_is_named_with_the_state_it_shows():
    # An AdamW parameter grown through .data (a vocabulary resized): the message uses the name
    # opt.state[p] shows ("momentum", not the engine's "exp_avg") and says how to go on.
    e = nn.Parameter(torch.randn(32, 16))
    opt = dion3.Dion3([dict(params=[e], algorithm="adamw", param_names=["embed.weight"])], lr=0.01)
    e.grad = torch.randn(32, 16)
    opt.step()
    e.data = torch.cat([e.data, torch.zeros(8, 16)])
    e.grad = torch.randn(40, 16)
    with pytest.raises(ValueError, match=r"'embed.weight': its state 'momentum' has shape \[32, 16\] but the "
                                         r"parameter, of shape \[40, 16\], needs \[40, 16\]"):
        opt.step()
    del opt.state[e]
    opt.step()
    assert opt.state[e]["step"] == 1


@pytest.mark.parametrize("bad", [float("nan"), -1.0])
def test_a_second_moment_written_in_place_with_a_bad_value_is_refused(device, bad):
    # As load_state_dict refuses it: NaN, or a negative running mean of squares, would poison
    # every later step. Nothing moves; set right again, the next step goes through.
    p = mat(device)
    opt = dion3.Dion3([p])
    p.grad = torch.randn_like(p)
    opt.step()
    var = opt.state[p]["variance_neuron"]
    keep = var[2, 0].item()
    var[2, 0] = bad
    w = p.detach().clone()
    with pytest.raises(ValueError, match="state 'variance_neuron'.*written since the last step .*holds .* at element 2"):
        opt.step()
    assert torch.equal(p, w)
    var[2, 0] = keep
    opt.step()
    assert not torch.equal(p, w)


def test_a_bad_second_moment_is_refused_across_a_rebuild(device):
    # Written in place, then the engine planned anew before the next step (a weight given new
    # storage): the new engine checks what the old one was told of.
    p = mat(device)
    opt = dion3.Dion3([p])
    p.grad = torch.randn_like(p)
    opt.step()
    opt.state[p]["variance_neuron"][0, 0] = float("nan")
    p.data = p.data.clone()  # the next step plans anew
    w = p.detach().clone()
    with pytest.raises(ValueError, match="written since the last step"):
        opt.step()
    assert torch.equal(p, w)


@pytest.mark.parametrize("cls", [dion3.Dion3, dion3.optim.Muon])
def test_a_misspelt_transposed_is_refused_by_every_matrix_optimizer(device, cls):
    with pytest.raises(ValueError, match=r"parameter group 0: unknown setting 'Transposed'; did you mean 'transposed'"):
        cls([dict(params=[mat(device)], Transposed=True)])


@pytest.mark.parametrize("setting, pattern", [
    (dict(split_sizes=(2**63, 12)), r"'split_sizes' must hold block sizes >= 1 and below 2\*\*63 \(64-bit\), got 9223372036854775808"),
    (dict(split_sizes=(-2**63 - 1, 12)), r"'split_sizes' must hold block sizes >= 1 and below 2\*\*63 \(64-bit\), got -9223372036854775809"),
    (dict(split_sizes=(2**64,)), r"'split_sizes' must hold block sizes >= 1"),
    (dict(num_heads=2**63), r"'num_heads' must be a positive integer \(64-bit\) or None"),
    # Refused for not dividing the rows at once, without a list of two billion heads first.
    (dict(num_heads=2**31 - 1), r"'num_heads' = 2147483647 does not divide them"),
])
def test_block_settings_past_64_bits_or_the_rows_are_refused_naming_the_group(device, setting, pattern):
    with pytest.raises(ValueError, match=r"group 0.*" + pattern):
        dion3.Dion3([dict(params=[mat(device, 12, 6)], **setting)])
    # Set after construction: refused at the next step, nothing changed.
    p = mat(device, 12, 6)
    opt = dion3.Dion3([p])
    opt.param_groups[0].update(setting)
    p.grad = torch.ones_like(p)
    before = p.detach().clone()
    with pytest.raises(ValueError, match=r"group 0.*" + pattern):
        opt.step()
    assert torch.equal(p.detach(), before)


def test_blocks_set_with_the_group_s_new_parameters_step(device):
    # A group's parameters and its split_sizes changed together: the new blocks are checked
    # against the new parameters, not the ones the engine held.
    a, b = mat(device, 8, 6), mat(device, 12, 6)
    opt = dion3.Dion3([dict(params=[a], split_sizes=[4, 4])])
    a.grad = torch.randn_like(a)
    opt.step()
    opt.param_groups[0]["params"] = [b]
    opt.param_groups[0]["split_sizes"] = [6, 6]
    b.grad = torch.randn_like(b)
    w = b.detach().clone()
    opt.step()
    assert not torch.equal(b, w)


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
    with pytest.raises(dion3.NonFiniteError, match="parameter 1 'group0.param1' of group 0 has a non-finite gradient"):
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


def test_dropped_steps_and_parameters_without_a_gradient_count_exactly(device):
    # Under 'skip' a CUDA step does not wait for its verdict: a dropped step is taken back from the
    # parameters it would have stepped, though the steps after it leave others without a gradient.
    torch.manual_seed(0)
    ps = [nn.Parameter(torch.randn(16, 24, device=device)) for _ in range(3)]
    opt = dion3.Dion3(ps, on_nonfinite="skip")
    want = [0, 0, 0]
    for absent, bad in [(None, False), (2, True), (0, False), (None, True), (1, False), (1, True), (2, False)]:
        for i, p in enumerate(ps):
            p.grad = None if i == absent else torch.randn_like(p)
        if bad:
            ps[1 if absent == 0 else 0].grad[0, 0] = float("nan")
        opt.step()
        want = [w + (not bad and i != absent) for i, w in enumerate(want)]
    assert opt.steps_skipped == 3
    assert [int(opt.state[p]["step"]) for p in ps] == want


def _after_small_steps(device, dtype=torch.float32, cls=dion3.Dion3):
    """A matrix after two applied steps of small gradients: its momentum bound is known."""
    p = mat(device, 16, 8, dtype=dtype)
    opt = cls([p], on_nonfinite="skip")
    for _ in range(2):
        p.grad = torch.full_like(p, 0.5)
        opt.step()
    return p, opt


def _step_applied(p, opt, g):
    """One step with every gradient element g: whether it was applied (else: dropped, nothing
    changed)."""
    before, skipped = p.detach().clone(), opt.steps_skipped
    p.grad = torch.full_like(p, g)
    opt.step()
    if opt.steps_skipped == skipped:
        return True
    assert torch.equal(p, before)
    return False


def _step_past_a_written_momentum(p, opt):
    """After the momentum was written at 0.9 x the dtype's largest value: a step with a gradient of
    0.2 x it, which overflows the sum (Dion3's M + G; Muon's and NorMuon's 0.95 M + G)."""
    return _step_applied(p, opt, 0.2 * torch.finfo(p.dtype).max)


@pytest.mark.parametrize("cls", [dion3.Dion3, dion3.Muon, dion3.NorMuon])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_momentum_written_in_place_is_checked_whole_again(device, dtype, cls):
    # Between steps the check bounds the momentum by the step's own last write and reads it only
    # where the gradient could overflow it; an in-place write (its tensor version moves) makes the
    # next step read it whole, and the step that would overflow it is dropped.
    big = torch.finfo(dtype).max
    p, opt = _after_small_steps(device, dtype, cls)
    opt.state[p]["momentum"].fill_(0.9 * big)
    momentum = opt.state[p]["momentum"].clone()
    assert not _step_past_a_written_momentum(p, opt)
    assert torch.equal(opt.state[p]["momentum"], momentum)
    # A write through .data leaves the version alone: state_changed() says so instead.
    opt.state[p]["momentum"].fill_(1.0)
    p.grad = torch.full_like(p, 0.5)
    opt.step()  # applied: the bound is small again
    opt.state[p]["momentum"].data.fill_(0.9 * big)
    opt.state_changed()
    assert not _step_past_a_written_momentum(p, opt)


@pytest.mark.parametrize("cls", [dion3.Dion3, dion3.Muon, dion3.NorMuon])
def test_the_momentum_bound_stays_in_use_across_plain_steps(device, cls):
    # Nothing the optimizer does itself between steps (state_dict, zero_grad, lr changes) counts as
    # a state write: after them a write the version does not show (.data, without state_changed())
    # is not read, and the step over it is applied (what state_changed() is for).
    p, opt = _after_small_steps(device, cls=cls)
    for step in range(3):
        opt.state_dict()
        opt.zero_grad()
        opt.param_groups[0]["lr"] = 0.01 / (step + 1)
        p.grad = torch.full_like(p, 0.5)
        opt.step()
    opt.state[p]["momentum"].data.fill_(0.9 * torch.finfo(p.dtype).max)
    assert _step_past_a_written_momentum(p, opt)


def test_inference_tensors_are_refused(device):
    # PyTorch refuses in-place writes to them outside inference_mode (torch.optim.AdamW's step
    # raises); the engine writes their memory directly, so it refuses them when they are added.
    with torch.inference_mode():
        lin = nn.Linear(8, 8, device=device)
    with pytest.raises(ValueError, match="inference tensor"):
        dion3.Dion3(dion3.param_groups(lin, lr=0.01), lr=0.01)
    opt = dion3.Dion3([mat(device)], lr=0.01)
    with pytest.raises(ValueError, match="inference tensor"):
        opt.add_param_group(dict(params=[lin.bias], algorithm="adamw"))
    assert len(opt.param_groups) == 1


def _adamw_after_small_steps(device, dtype):
    """An AdamW vector after two applied steps of small gradients: its moments' bounds are known."""
    b = nn.Parameter(torch.zeros(64, device=device, dtype=dtype))
    opt = dion3.Dion3([dict(params=[b], algorithm="adamw", betas=(0.9, 0.95))], on_nonfinite="skip")
    for _ in range(2):
        b.grad = torch.full_like(b, 0.5)
        opt.step()
    return b, opt


def _step_past_a_written_second_moment(b, opt):
    """After the second moment ("variance") was written at 0.9 x the dtype's largest value: a step
    with a gradient below the bounds' limit (about 4e19 here) whose square still takes the second
    moment past it."""
    return _step_applied(b, opt, 3.6e19)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adamw_moments_written_in_place_are_checked_whole_again(device, dtype):
    # AdamW's check reads the moments only where the gradient could take them past the bounds
    # its own steps keep; an in-place write makes the next step read them whole.
    b, opt = _adamw_after_small_steps(device, dtype)
    opt.state[b]["variance"].fill_(0.9 * torch.finfo(dtype).max)
    assert not _step_past_a_written_second_moment(b, opt)
    opt.state[b]["variance"].fill_(1.0)
    b.grad = torch.full_like(b, 0.5)
    opt.step()  # applied: the bounds are known again
    opt.state[b]["variance"].data.fill_(0.9 * torch.finfo(dtype).max)
    opt.state_changed()
    assert not _step_past_a_written_second_moment(b, opt)


def test_the_adamw_bounds_stay_in_use_across_plain_steps(device):
    # As for the momentum: a write the version does not show, without state_changed(), is not
    # read, and the step over it is applied.
    b, opt = _adamw_after_small_steps(device, torch.float32)
    opt.state[b]["variance"].data.fill_(0.9 * torch.finfo(torch.float32).max)
    assert _step_past_a_written_second_moment(b, opt)


@pytest.mark.parametrize("written", ["in place", ".data"])
def test_lions_moment_is_checked_whole_again_after_an_in_place_write(device, written):
    # Lion keeps one bound (its moment's largest magnitude): an in-place write makes the next step
    # read the moment whole and drop the step whose g - m would overflow; a write through .data
    # without state_changed() is not read (the bound is in use), and that step is applied.
    big = torch.finfo(torch.float32).max
    b = nn.Parameter(torch.zeros(64, device=device))
    opt = dion3.Dion3([dict(params=[b], algorithm="lion", lr=1e-3, betas=(0.9, 0.5))], on_nonfinite="skip")
    for _ in range(2):
        b.grad = torch.full_like(b, 0.5)
        opt.step()
    moment = opt.state[b]["momentum"]
    (moment if written == "in place" else moment.data).fill_(0.9 * big)
    # Below the limit of the small bound (a quarter of the largest value), but g - m overflows.
    assert _step_applied(b, opt, -0.2 * big) == (written == ".data")


def test_refresh_hyperparameters_refuses_a_parameter_that_gained_a_gradient(device):
    # Without a gradient when the step was planned, it is not in it: a replay would never update
    # it, so a new capture is asked for; the next eager step takes it in.
    w, b = mat(device), nn.Parameter(torch.zeros(4, device=device))
    opt = dion3.Dion3([dict(params=[w]), dict(params=[b], algorithm="adamw")])
    w.grad = torch.randn_like(w)
    opt.step()
    opt.refresh_hyperparameters()
    b.grad = torch.ones_like(b)
    with pytest.raises(RuntimeError, match="capture again"):
        opt.refresh_hyperparameters()
    opt.step()
    assert b.detach().abs().sum() > 0
    opt.refresh_hyperparameters()


def test_refresh_hyperparameters_refuses_gradients_in_other_memory(device):
    # A replay reads the gradients where the last step bound them: new .grad tensors elsewhere
    # (model.zero_grad(), then backward) ask for a new capture; the same memory does not (a new
    # view of a flat buffer, or a gradient written in place).
    w, v = mat(device), mat(device, 4, 6)
    flat = torch.zeros(w.numel() + v.numel(), device=device)
    opt = dion3.Dion3([w, v])

    def from_flat():
        w.grad, v.grad = flat[:w.numel()].view_as(w), flat[w.numel():].view_as(v)

    from_flat()
    flat.normal_()
    opt.step()
    opt.refresh_hyperparameters()
    from_flat()  # new tensors, same memory
    w.grad.mul_(2.0)
    opt.refresh_hyperparameters()
    v.grad = torch.randn_like(v)
    with pytest.raises(RuntimeError, match="capture again"):
        opt.refresh_hyperparameters()
    opt.step()  # binds the new one
    opt.refresh_hyperparameters()


def test_refresh_hyperparameters_keeps_an_in_place_state_write(device):
    # refresh_hyperparameters() (what a replay of a captured step needs) notices an in-place state
    # write as step() would, and does not swallow it: the step after it still reads the momentum.
    p, opt = _after_small_steps(device)
    opt.state[p]["momentum"].fill_(0.9 * torch.finfo(p.dtype).max)
    opt.refresh_hyperparameters()
    assert not _step_past_a_written_momentum(p, opt)


@pytest.mark.parametrize("moved", ["weight", "momentum", "gradient"])
def test_refresh_hyperparameters_refuses_storage_moved_since_the_capture(device, moved):
    # A captured step uses the tensors where they were at capture: after p.data = ... (or the same
    # on a state tensor or the gradient) a replay would use storage nobody reads any more, so
    # refresh_hyperparameters() asks for a new capture; the next eager step follows the new storage.
    p, opt = _after_small_steps(device)
    opt.refresh_hyperparameters()
    t = {"weight": p, "momentum": opt.state[p]["momentum"], "gradient": p.grad}[moved]
    t.data = t.data.clone()
    with pytest.raises(RuntimeError, match="capture again"):
        opt.refresh_hyperparameters()
    before = p.detach().clone()
    opt.step()
    assert not torch.equal(p, before)
    opt.refresh_hyperparameters()


def test_cuda_tensors_without_cuda_build():
    if not torch.cuda.is_available() or dion3.cuda_built():
        pytest.skip("needs a GPU and a CPU-only build")
    p = nn.Parameter(torch.randn(8, 4, device="cuda"))
    opt = dion3.Dion3([p])
    p.grad = torch.randn_like(p)
    with pytest.raises(NotImplementedError, match="no CUDA backend"):
        opt.step()


# ---- load_state_dict: everything checked before anything is replaced ---------------------------

def _trained(device, seed, dtype=torch.float32):
    """A Dion3 matrix, a NorMuon matrix and an AdamW vector after two steps (state not zero)."""
    torch.manual_seed(seed)
    ps = [mat(device, 8, 6, dtype=dtype), mat(device, 6, 4, dtype=dtype),
          nn.Parameter(torch.randn(5, device=device, dtype=dtype))]
    opt = dion3.Dion3([dict(params=ps[:1]), dict(params=ps[1:2], algorithm="normuon"),
                       dict(params=ps[2:], algorithm="adamw")])
    for _ in range(2):
        for p in ps:
            p.grad = torch.randn_like(p)
        opt.step()
    return ps, opt


def _same_state_dict(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for pid in a["state"]:
        sa, sb = a["state"][pid], b["state"][pid]
        assert sa.keys() == sb.keys(), pid
        for k in sa:
            if torch.is_tensor(sa[k]):
                assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), (pid, k)
            else:
                assert sa[k] == sb[k], (pid, k)


def _nan_at(t, i):
    t.view(-1)[i] = float("nan")


# (what to break in a state_dict saved by another optimizer, what the error says)
BAD_LOADS = {
    "missing_momentum": (lambda sd: sd["state"][0].pop("momentum"), "parameter 0 'group0.param0' of group 0 has no state 'momentum'"),
    "missing_variance": (lambda sd: sd["state"][1].pop("variance_neuron"), "has no state 'variance_neuron'"),
    # A parameter without its own counter takes its group's (the reference's layout); with neither:
    "missing_step": (lambda sd: (sd["state"][2].pop("step"), sd["param_groups"][2].pop("step")),
                     "'group2.param0' of group 2 has no step counter"),
    "momentum_shape": (lambda sd: sd["state"][0].update(momentum=torch.zeros(6, 8)), r"state 'momentum' has shape \[6, 8\], expected \[8, 6\]"),
    "variance_shape": (lambda sd: sd["state"][1].update(variance_neuron=torch.zeros(4)), r"state 'variance_neuron' has shape \[4\], expected \[6, 1\]"),
    "integer_state": (lambda sd: sd["state"][2].update(momentum=torch.zeros(5, dtype=torch.int32)), "state 'momentum' is int32, not a floating-point tensor"),
    "nan_momentum": (lambda sd: _nan_at(sd["state"][0]["momentum"], 7), "state 'momentum' .* holds NaN at element 7; state values must be finite"),
    "inf_adamw_momentum": (lambda sd: sd["state"][2]["momentum"].__setitem__(4, float("-inf")), "state 'momentum' .* holds -Inf at element 4"),
    "negative_adamw_variance": (lambda sd: sd["state"][2]["variance"].__setitem__(1, -0.5), "state 'variance' .* holds -0.5 at element 1; a second moment cannot be negative"),
    "negative_variance_neuron": (lambda sd: sd["state"][1]["variance_neuron"].view(-1).__setitem__(3, -1e-3), "state 'variance_neuron' .* holds -0.001.* at element 3"),
    "negative_step": (lambda sd: sd["state"][0].update(step=-1), "has step -1; a step counter must be an integer in"),
    "step_would_overflow": (lambda sd: sd["state"][2].update(step=2**63 - 1), "has step 9223372036854775807"),
    "step_later_steps_would_overflow": (lambda sd: sd["state"][2].update(step=2**63 - 2), r"has step 9223372036854775806; a step counter must be an integer in \[0, 2\*\*62\]"),
    "fractional_step": (lambda sd: sd["state"][2].update(step=1.5), "has step 1.5"),
    "bad_group_setting": (lambda sd: sd["param_groups"][1].update(lr=-1.0), "parameter group 1: 'lr' must be a finite number"),
    "group_count": (lambda sd: sd["param_groups"].pop(), "the state_dict has 2 parameter groups but the optimizer has 3"),
}


@pytest.mark.parametrize("case", list(BAD_LOADS))
def test_refused_load_state_dict_changes_nothing(device, case):
    import copy
    _, src = _trained(device, seed=1)
    sd = copy.deepcopy(src.state_dict())
    breaker, pattern = BAD_LOADS[case]
    breaker(sd)
    ps, opt = _trained(device, seed=2)
    before = copy.deepcopy(opt.state_dict())
    control = copy.deepcopy(opt)
    with pytest.raises(ValueError, match=pattern):
        opt.load_state_dict(sd)
    _same_state_dict(opt.state_dict(), before)
    # ... and the next step is the one the optimizer would have taken without the attempt.
    qs = [q for g in control.param_groups for q in g["params"]]
    for p, q in zip(ps, qs):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    opt.step()
    control.step()
    for p, q in zip(ps, qs):
        assert torch.equal(p, q)
    _same_state_dict(opt.state_dict(), control.state_dict())


def test_load_state_dict_checks_half_precision_values_as_stored(device):
    import copy
    _, src = _trained(device, seed=3, dtype=torch.bfloat16)
    sd = copy.deepcopy(src.state_dict())
    sd["state"][2]["variance"][0] = float("inf")
    _, opt = _trained(device, seed=4, dtype=torch.bfloat16)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"state 'variance' \(bfloat16\) holds \+Inf at element 0"):
        opt.load_state_dict(sd)
    _same_state_dict(opt.state_dict(), before)


@pytest.mark.parametrize("edit,message", [
    (lambda sd: sd["param_groups"][1].update(lr=None), r"parameter group 1: 'lr' must be a number; got None"),
    (lambda sd: sd["param_groups"][2].update(weight_decay=[0.1]), r"parameter group 2: 'weight_decay' must be a number"),
    (lambda sd: sd["param_groups"][0].update(algorithm=["dion3"]), r"parameter group 0: 'algorithm' must be one of"),
    (lambda sd: sd["param_groups"][1].update(transposed="no"), r"parameter group 1: 'transposed' must be True or False"),
    (lambda sd: sd["param_groups"][2].pop("params"), r"parameter group 2 of the state_dict is not a dict with a 'params' list"),
    (lambda sd: sd["state"][0].update(momentum=torch.empty(8, 6, device="meta")),
     r"parameter 0 'group0.param0' of group 0: state 'momentum' is on the meta device"),
])
def test_a_malformed_checkpoint_is_refused_naming_what_is_wrong(device, edit, message):
    # Settings of the wrong type or structure read as a ValueError that names the group (or the
    # parameter), not as a TypeError or KeyError from deep inside the load; nothing is loaded.
    import copy
    _, src = _trained(device, seed=7)
    sd = copy.deepcopy(src.state_dict())
    edit(sd)
    _, opt = _trained(device, seed=8)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(sd)
    _same_state_dict(opt.state_dict(), before)


@pytest.mark.parametrize("key,value", [("lr", None), ("weight_decay", None), ("betas", None), ("betas", 0.9)])
def test_a_setting_of_the_wrong_type_is_refused_at_the_step_naming_its_group(device, key, value):
    ps, opt = _trained(device, seed=9)
    opt.param_groups[2][key] = value
    before = [p.detach().clone() for p in ps]
    for p in ps:
        p.grad = torch.randn_like(p)
    with pytest.raises(ValueError, match=rf"^dion3: parameter group 2: '{key}' must be"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(ps, before))


def test_load_state_dict_casts_state_to_what_the_group_needs(device):
    # fp32 state saved next to fp32 weights loads next to bf16 ones: momentum and AdamW moments
    # follow the weights (as torch's optimizers do), the NorMuon variance stays fp32.
    import copy
    _, src = _trained(device, seed=5)
    sd = copy.deepcopy(src.state_dict())
    ps, opt = _trained(device, seed=6, dtype=torch.bfloat16)
    opt.load_state_dict(sd)
    assert opt.state[ps[0]]["momentum"].dtype == torch.bfloat16
    assert opt.state[ps[1]]["variance_neuron"].dtype == torch.float32
    assert opt.state[ps[2]]["variance"].dtype == torch.bfloat16
    assert opt.state[ps[2]]["step"] == 2
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    assert opt.state[ps[2]]["step"] == 3


@pytest.mark.parametrize("dtype, value, grad", [(torch.float32, -1.0, 0.5), (torch.float16, -2.0**-24, 6.3e-3)])
def test_a_negative_adamw_second_moment_written_in_place_is_refused(device, dtype, value, grad):
    # load_state_dict refuses a negative second moment; one written in place is refused by the
    # next step as well (the update would divide by its square root), even under 'skip' (a state
    # that stays wrong would drop every later step): nothing is changed. The float16 case: a
    # negative value that would round to -0 in the new second moment.
    p = nn.Parameter(torch.full((8,), 0.5, device=device, dtype=dtype))
    opt = dion3.Dion3([dict(params=[p], algorithm="adamw", betas=(0.9, 0.999))], on_nonfinite="skip")
    p.grad = torch.full_like(p, grad)
    opt.step()
    with torch.no_grad():
        opt.state[p]["variance"].zero_()
        opt.state[p]["variance"][0] = value
    state = {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
    before = p.detach().clone()
    p.grad = torch.full_like(p, grad)
    # Named as opt.state[p] shows it ('variance'), not by the engine's name (exp_avg_sq).
    with pytest.raises(ValueError, match="state 'variance'.*written since the last step.*cannot be negative"):
        opt.step()
    assert opt.steps_skipped == 0 and torch.equal(p, before)
    assert all(torch.equal(opt.state[p][k], v) for k, v in state.items())


@pytest.mark.parametrize("which", ["weight", "momentum"])
def test_a_storage_shrunk_in_place_is_refused(device, which):
    # untyped_storage().resize_ to fewer bytes than the tensor spans: the step refuses it by name
    # instead of writing past the storage's end.
    p = mat(device, 16, 8)
    opt = dion3.Dion3([p])
    p.grad = torch.randn_like(p)
    opt.step()
    t = p if which == "weight" else opt.state[p]["momentum"]
    t.untyped_storage().resize_(64 * t.element_size())
    p.grad = torch.randn_like(p)
    with pytest.raises(ValueError, match="past the end of its storage"):
        opt.step()


def test_raised_step_counts_nowhere(device):
    p = mat(device)
    opt = dion3.Dion3([p])
    p.grad = torch.randn_like(p)
    opt.step()
    p.grad[0, 0] = float("nan")
    with pytest.raises(dion3.NonFiniteError):
        opt.step()
    # Not a skipped step: neither the front end's counter nor the engine's (which a captured
    # CUDA graph's counters are folded from) moves.
    assert opt.steps_skipped == 0 and opt._engine.steps_skipped == 0 and opt._engine.steps_taken == 1
    assert opt.state[p]["step"] == 1


# ---- a tensor optimized twice -----------------------------------------------------------------

def test_same_parameter_twice_in_a_group(device):
    p, q = mat(device), mat(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own "duplicate parameters" warning comes first
        with pytest.raises(ValueError, match="parameter 2 'group0.param2' of group 0 is the same tensor as "
                                             "parameter 0 'group0.param0' of group 0"):
            dion3.Dion3([p, q, p])


def test_same_parameter_in_two_groups(device):
    p, q = mat(device), mat(device)
    opt = dion3.Dion3([p])
    with pytest.raises(ValueError, match="parameter 1 'group1.param1' of group 1 is the same tensor as "
                                         "parameter 0 'group0.param0' of group 0"):
        opt.add_param_group(dict(params=[q, p]))
    assert len(opt.param_groups) == 1
    with pytest.raises(ValueError, match="parameter 0 'b' of group 1 is the same tensor as parameter 0 'a' of group 0"):
        dion3.Dion3([dict(params=[p], param_names=["a"]), dict(params=[p], param_names=["b"])])
    # The refusal leaves the alias index as it was: q joins, and p again is still refused.
    opt.add_param_group(dict(params=[q]))
    with pytest.raises(ValueError, match="same tensor as parameter 0 'group1.param0' of group 1"):
        opt.add_param_group(dict(params=[q]))
    assert len(opt.param_groups) == 2


@pytest.mark.parametrize("how", ["overlapping_views", "same_storage_twice", "across_groups"])
def test_parameters_sharing_memory_are_refused(device, how):
    base = torch.randn(12, 4, device=device)
    if how == "overlapping_views":
        a, b = nn.Parameter(base[0:6]), nn.Parameter(base[4:10])
    else:
        a, b = nn.Parameter(base), nn.Parameter(base)  # two Parameters, one storage
    if how == "across_groups":
        opt = dion3.Dion3([mat(device), a])
        with pytest.raises(ValueError, match="parameter 0 'group1.param0' of group 1 shares memory with "
                                             "parameter 1 'group0.param1' of group 0"):
            opt.add_param_group(dict(params=[b]))
        assert len(opt.param_groups) == 1
        return
    with pytest.raises(ValueError, match="'group0.param1' of group 0 shares memory with .*'group0.param0'"):
        dion3.Dion3([a, b])


def test_disjoint_views_and_tied_weights_given_once_are_fine(device):
    base = torch.randn(12, 4, device=device)
    a, b = nn.Parameter(base[0:6]), nn.Parameter(base[6:12])  # adjacent, not overlapping
    emb = nn.Embedding(10, 4).to(device)
    head = nn.Linear(4, 10, bias=False).to(device)
    head.weight = emb.weight  # tied: one parameter
    model = nn.ModuleList([emb, head])
    tied = list(model.parameters())
    assert len(tied) == 1
    opt = dion3.Dion3([a, b] + tied)
    for p in [a, b] + tied:
        p.grad = torch.randn_like(p)
    opt.step()
    assert all(opt.state[p]["step"] == 1 for p in [a, b] + tied)


def test_add_param_group_checks_the_groups_as_they_are_now(device):
    # Moving a parameter to a group of its own (torch's idiom for a learning rate of its own),
    # re-adding a deleted group, and a cast that frees the storage the index remembers: each is
    # accepted, as by torch.optim; a real repeat is still refused.
    a, b = mat(device), mat(device)
    opt = dion3.Dion3([a, b], lr=0.02)
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    opt.step()
    del opt.param_groups[0]["params"][1]
    opt.add_param_group(dict(params=[b], lr=1e-3))
    opt.step()
    assert [len(g["params"]) for g in opt.param_groups] == [1, 1] and opt.state[b]["step"] == 2
    with pytest.raises(ValueError, match="parameter 0 'group2.param0' of group 2 is the same tensor as "
                                         "parameter 0 'group1.param0' of group 1"):
        opt.add_param_group(dict(params=[b]))
    opt = dion3.Dion3([dict(params=[a]), dict(params=[b], lr=0.1)], lr=0.02)
    del opt.param_groups[1]
    opt.add_param_group(dict(params=[b], lr=1e-3))
    model = nn.Linear(64, 64, bias=False).to(device)
    opt = dion3.Dion3(model.parameters())
    old = model.weight.detach()
    model.half()
    del old  # the index's span is free memory now
    new = [nn.Parameter(torch.randn(64, 64, device=device, dtype=torch.half)) for _ in range(4)]
    for p in new:
        opt.add_param_group(dict(params=[p]))
    assert len(opt.param_groups) == 5


def test_storage_shared_after_construction_is_refused_at_the_step(device):
    a, b = mat(device), mat(device)
    opt = dion3.Dion3([a, b])
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    opt.step()
    b.data = a.data
    with pytest.raises(ValueError, match="'group0.param1' of group 0 shares memory with .*'group0.param0'"):
        opt.step()
    assert opt.state[a]["step"] == 1


@pytest.mark.parametrize("key, pattern", [
    ("fractoin", r"unknown setting 'fractoin'; did you mean 'fraction'\?"),
    ("weight_decya", r"unknown setting 'weight_decya'; did you mean 'weight_decay'\?"),
    ("eps", r"unknown setting 'eps'; dion3 calls it 'epsilon'"),
    ("momentum", r"dion3 calls it 'mu'"),
    ("split_size", r"unknown setting 'split_size'; did you mean 'split_sizes'\?"),
    ("num_head", r"unknown setting 'num_head'; did you mean 'num_heads'\?"),
    # A setting no optimizer puts in its defaults, all the same.
    ("transpose", r"unknown setting 'transpose'; did you mean 'transposed'\?"),
    ("tranposed", r"unknown setting 'tranposed'; did you mean 'transposed'\?"),
    # Other optimizers' names, refused though they hold a setting's name (a tag's shape).
    ("rank_fraction", r"unknown setting 'rank_fraction'; dion3 calls it 'fraction'"),
    ("adjust_lr_fn", r"dion3 calls it 'adjust_lr'"),
    ("ns_coefficients", r"dion3 calls it 'coefficients'"),
    ("nesterov_momentum", r"dion3 calls it 'nesterov'"),
])
def test_group_keys_that_would_be_ignored_are_refused(device, key, pattern):
    with pytest.raises(ValueError, match=r"parameter group 0: .*" + pattern):
        dion3.Dion3([dict(params=[mat(device)], **{key: 1})])
    opt = dion3.Dion3([mat(device)])
    with pytest.raises(ValueError, match=r"parameter group 1: .*" + pattern):
        opt.add_param_group(dict(params=[mat(device)], **{key: 1}))
    assert len(opt.param_groups) == 1
    # A key set on a group after construction is caught at the next step, before any change.
    p = opt.param_groups[0]["params"][0]
    p.grad = torch.ones_like(p)
    before = p.detach().clone()
    opt.param_groups[0][key] = 1
    with pytest.raises(ValueError, match=pattern):
        opt.step()
    assert torch.equal(p.detach(), before)


@pytest.mark.parametrize("key", ["no_weight_decay", "use_weight_decay", "weight_decay_rate", "apply_weight_decay",
                                 "num_steps", "moment", "momentum_decay", "l1", "l2", "nu"])
def test_user_tags_more_than_one_letter_from_a_setting_are_carried(device, key):
    # Only a key one edit from a setting's name is taken for a typo; a training script's own group
    # tags, however alike, are carried as torch.optim carries them (dion3.optim.Muon included).
    for cls in (dion3.Dion3, dion3.optim.Muon):
        p = mat(device)
        opt = cls([dict(params=[p], **{key: True})])
        p.grad = torch.ones_like(p)
        opt.step()
        assert opt.param_groups[0][key] is True


def test_betas_may_be_any_pair_of_numbers(device):
    for betas in ((0.9, 0.95), [0.9, 0.95], torch.tensor([0.9, 0.95]), np.array([0.9, 0.95])):
        p = mat(device)
        opt = dion3.Dion3([dict(params=[p], algorithm="adamw", betas=betas)])
        p.grad = torch.ones_like(p)
        opt.step()


def test_scheduler_and_user_keys_are_carried(device):
    p = mat(device)
    opt = dion3.Dion3([dict(params=[p], layer_id=3, name="blocks.0")])
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.02, total_steps=4, cycle_momentum=False)
    p.grad = torch.ones_like(p)
    opt.step()
    sched.step()
    assert opt.param_groups[0]["layer_id"] == 3 and "initial_lr" in opt.param_groups[0]
    # A setting's own record or tag: a weight-decay scheduler's initial value (timm's Scheduler base
    # writes initial_<field>), a per-group multiplier.
    for key in ("initial_weight_decay", "weight_decay_mult", "initial_fraction", "lr_scale"):
        opt.param_groups[0][key] = 0.5
    opt.step()
    assert opt.param_groups[0]["weight_decay_mult"] == 0.5


def test_sparse_gradient_is_named(device):
    emb = nn.Embedding(16, 8, sparse=True).to(device)
    opt = dion3.Dion3([dict(params=[emb.weight], param_names=["emb.weight"])])
    emb(torch.tensor([1, 2], device=device)).sum().backward()
    assert emb.weight.grad.is_sparse
    before = emb.weight.detach().clone()
    with pytest.raises(ValueError, match=r"'emb.weight'.*sparse; dion3 steps dense gradients only"):
        opt.step()
    assert torch.equal(emb.weight.detach(), before)


def test_1d_error_suggests_param_groups(device):
    model = nn.Linear(4, 4).to(device)
    with pytest.raises(ValueError, match=r"dion3.param_groups\(model\)"):
        dion3.Dion3(model.parameters())


def test_missing_extension_is_reported_clearly(tmp_path):
    # A copy of the package without its compiled extension, imported in a fresh interpreter.
    import os
    import shutil
    import subprocess
    import sys
    src = os.path.dirname(dion3.__file__)
    shutil.copytree(src, tmp_path / "dion3", ignore=shutil.ignore_patterns("_C*", "__pycache__"))
    r = subprocess.run([sys.executable, "-c", "import dion3"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode != 0
    assert "compiled extension dion3._C is missing" in r.stderr
    assert "circular import" not in r.stderr


def test_a_setting_added_after_construction_is_checked_at_the_next_step(device):
    # group["momentum"] = ... (another optimizer's name for mu, e.g. a momentum warm-up written for
    # torch's SGD) would otherwise be ignored while the schedule seems to run.
    w = mat(device)
    opt = dion3.Muon([w], lr=0.02)
    w.grad = torch.randn_like(w)
    opt.step()
    opt.param_groups[0]["momentum"] = 0.9
    before = w.detach().clone()
    with pytest.raises(ValueError, match="parameter group 0: unknown setting 'momentum'; dion3 calls it 'mu'"):
        opt.step()
    assert torch.equal(w, before)
    del opt.param_groups[0]["momentum"]
    opt.param_groups[0]["layer_index"] = 3  # a user's own tag is carried, as torch.optim does
    opt.step()
    assert not torch.equal(w, before)


def test_a_refused_first_step_after_an_algorithm_switch_keeps_the_old_state(device):
    # The switch makes fresh state for the new kind; a first step that raises (here a NaN
    # gradient) applied nothing, so the old kind's state is kept, and the next step starts afresh.
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(6, device=device))
    opt = dion3.Dion3([{"params": [w], "algorithm": "adamw"}], lr=0.01)
    w.grad = torch.randn(6, device=device)
    opt.step()
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[w].items()}
    opt.param_groups[0]["algorithm"] = "lion"
    w.grad = torch.full((6,), float("nan"), device=device)
    with pytest.raises(dion3.NonFiniteError):
        opt.step()
    assert set(opt.state[w]) == set(before)
    for k, v in before.items():
        assert torch.equal(opt.state[w][k], v) if isinstance(v, torch.Tensor) else opt.state[w][k] == v, k
    w.grad = torch.randn(6, device=device)
    opt.step()
    assert opt.state[w]["step"] == 1  # lion's own count, from a fresh start


def test_a_vector_appended_to_a_matrix_group_is_refused_by_name():
    # Appended to the group's list after construction: the step refuses it as the constructor
    # would (not an internal error from making its state first), and state_dict() still works.
    w, b = torch.nn.Parameter(torch.randn(8, 12)), torch.nn.Parameter(torch.randn(8))
    opt = dion3.Dion3([w], lr=0.02)
    opt.param_groups[0]["params"].append(b)
    w.grad, b.grad = torch.randn(8, 12), torch.randn(8)
    with pytest.raises(ValueError, match=r"has shape \[8\] but Dion3 needs a matrix"):
        opt.step()
    assert sorted(opt.state_dict()["state"]) == [0]


def _stepped_pair(names):
    """Two 8 x 12 parameters named `names` in one Dion3 group, stepped once: (a, b, opt)."""
    a, b = torch.nn.Parameter(torch.randn(8, 12)), torch.nn.Parameter(torch.randn(8, 12))
    opt = dion3.Dion3([dict(params=[a, b], param_names=list(names))], lr=0.02)
    a.grad, b.grad = torch.randn(8, 12), torch.randn(8, 12)
    opt.step()
    return a, b, opt


def test_a_checkpoint_with_its_parameter_names_in_another_order_is_refused():
    # State goes by position: the same names in another order would swap two layers' momenta.
    a, b, opt = _stepped_pair(["x.weight", "y.weight"])
    sd = opt.state_dict()
    swapped = dion3.Dion3([dict(params=[b, a], param_names=["y.weight", "x.weight"])], lr=0.02)
    before = {k: v.clone() for k, v in swapped.state[b].items() if torch.is_tensor(v)}
    with pytest.raises(ValueError, match="same parameter names in another order .position 0: 'x.weight' there, "
                                         "'y.weight' here"):
        swapped.load_state_dict(sd)
    assert all(torch.equal(v, swapped.state[b][k]) for k, v in before.items())
    renamed = dion3.Dion3([dict(params=[a, b], param_names=["module.x.weight", "module.y.weight"])], lr=0.02)
    renamed.load_state_dict(sd)  # other names (a wrapper's prefix) still load by position


def _state_copy(opt):
    """The optimizer's state as plain values, to compare before and after a refused load."""
    return [{k: v.tolist() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
            for g in opt.param_groups for p in g["params"]]


def test_a_checkpoint_whose_groups_hold_the_named_parameters_otherwise_is_refused():
    # Two same-shape parameters in swapped groups pass every shape check; by position each would
    # take the other's state and lr.
    a, b, c = (torch.nn.Parameter(torch.randn(8, 12)) for _ in range(3))

    def build(first, second):
        return dion3.Dion3([dict(params=[c], param_names=["mid"]),
                            dict(params=[first[1]], param_names=[first[0]], algorithm="adamw", lr=1e-3),
                            dict(params=[second[1]], param_names=[second[0]], algorithm="adamw", lr=1e-4)], lr=0.02)
    opt = build(("embed", a), ("head", b))
    for p in (a, b, c):
        p.grad = torch.randn(8, 12)
    opt.step()
    sd = opt.state_dict()
    swapped = build(("head", b), ("embed", a))
    before = _state_copy(swapped)
    with pytest.raises(ValueError, match=r"hold these parameters otherwise.*'head' \(group 2 there, 1 here\)"):
        swapped.load_state_dict(sd)
    assert _state_copy(swapped) == before and swapped.param_groups[1]["lr"] == 1e-3
    build(("embed", a), ("head", b)).load_state_dict(sd)


def test_betas_and_beta1_beta2_that_disagree_are_refused():
    # state_dict() writes both spellings: one of them edited (a load pre-hook setting betas) is
    # not silently overridden by the other.
    w, v = torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))
    groups = lambda: [dict(params=[w]), dict(params=[v], algorithm="adamw")]  # noqa: E731
    opt = dion3.Dion3(groups(), lr=0.02, betas=(0.9, 0.95))
    w.grad, v.grad = torch.randn(8, 4), torch.randn(4)
    opt.step()
    sd = opt.state_dict()
    sd["param_groups"][1]["betas"] = (0.5, 0.999)
    fresh = dion3.Dion3(groups(), lr=0.02, betas=(0.9, 0.95))
    before = _state_copy(fresh)
    with pytest.raises(ValueError, match=r"group 1 of the state_dict holds betas \(0.5, 0.999\) and beta1/beta2 "
                                         r"\(0.9, 0.95\), which disagree"):
        fresh.load_state_dict(sd)
    assert _state_copy(fresh) == before and fresh.param_groups[1]["betas"] == (0.9, 0.95)
    del sd["param_groups"][1]["beta1"], sd["param_groups"][1]["beta2"]
    fresh.load_state_dict(sd)
    assert tuple(fresh.param_groups[1]["betas"]) == (0.5, 0.999)
    ref = opt.state_dict()  # the reference package's keys alone still replace betas
    for g in ref["param_groups"]:
        del g["betas"]
    ref["param_groups"][1]["beta1"] = 0.8
    fresh.load_state_dict(ref)
    assert tuple(fresh.param_groups[1]["betas"]) == (0.8, 0.95)


def test_saved_names_that_do_not_match_the_group_in_number_are_not_taken():
    # A distributed checkpoint of a larger model loads by name (its groups' params rebuilt for
    # the live model) but keeps its name lists: the live names stay, so errors name the right layer.
    a, b, opt = _stepped_pair(["x.weight", "z.weight"])
    sd = opt.state_dict()
    sd["param_groups"][0]["param_names"] = ["x.weight", "y.weight", "z.weight"]
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["param_names"] == ["x.weight", "z.weight"]
    b.grad = torch.full((8, 12), float("nan"))
    with pytest.raises(dion3.NonFiniteError, match="'z.weight'"):
        opt.step()
    unnamed = dion3.Dion3([a, b], lr=0.02)
    unnamed.load_state_dict(sd)
    assert "param_names" not in unnamed.param_groups[0]


def test_a_process_group_this_rank_is_not_in_is_named_as_such():
    # dist.new_group(ranks) hands the ranks outside it a marker, not a group.
    import torch.distributed as dist
    w = nn.Parameter(torch.randn(8, 12))
    with pytest.raises(ValueError, match="a process group this rank is not in"):
        dion3.Dion3([w], distributed_mesh=dist.GroupMember.NON_GROUP_MEMBER)


def test_cuda_graph_capture_refuses_parameters_off_the_gpu():
    # The capture would record nothing of a CPU engine's step, and every replay would then leave
    # the weights alone: refused by name when the capture comes, after the eager warm-up steps.
    from dion3.cuda_graph import CudaGraphOptimizer
    w = nn.Parameter(torch.randn(8, 4))
    opt = CudaGraphOptimizer(dion3.Dion3([dict(params=[w], param_names=["w"])]), warmup_steps=1)
    w.grad = torch.randn_like(w)
    opt.step()
    with pytest.raises(RuntimeError, match="parameter 0 'w' of group 0 is on cpu; a CUDA graph captures steps of "
                                           "CUDA parameters"):
        opt.step()


def test_a_load_into_groups_built_otherwise_names_the_parameters_that_moved():
    # A checkpoint whose groups were built otherwise (param_groups of another version, other
    # overrides): the refusal says which parameters sit in other groups, and what to do.
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    saved = dion3.Dion3(dion3.param_groups(model, lr=0.02), lr=0.02).state_dict()
    regrouped = dion3.Dion3(dion3.param_groups(model, lr=0.02, overrides={"1.weight": dict(algorithm="adamw")}),
                            lr=0.02)
    with pytest.raises(ValueError, match=r"'1\.weight' \(group 0 there, 2 here\)\. Build the groups as the "
                                         r"checkpoint's were"):
        regrouped.load_state_dict(saved)


# ---- interrupted calls and what they leave ------------------------------------------------------

@contextlib.contextmanager
def _interrupts(seconds):
    """Raises KeyboardInterrupt (as Ctrl-C does) after `seconds`, once, inside the block."""
    armed = True

    def handler(signum, frame):
        if armed:
            raise KeyboardInterrupt
    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_a_step_interrupted_anywhere_leaves_its_lock_free():
    # A Ctrl-C landing right after the step lock was taken, before the step saw it had, kept it
    # held: every later step from another thread was then refused.
    import random
    import threading
    rng = random.Random(0)
    w = nn.Parameter(torch.randn(16, 24))
    opt = dion3.Dion3([w], lr=0.02)
    interrupted = 0
    for _ in range(3000):
        w.grad = torch.randn(16, 24)
        try:
            with _interrupts(rng.uniform(1e-6, 40e-6)):
                opt.step()
        except KeyboardInterrupt:
            interrupted += 1
        assert not opt._step_lock._is_owned()
    # torch.no_grad around the step (as around torch.optim's) may be left entered by the interrupt.
    torch.set_grad_enabled(True)
    assert interrupted > 0
    errors = []
    thread = threading.Thread(target=lambda: errors.append(opt._step_lock.acquire(blocking=False)))
    thread.start()
    thread.join()
    assert errors == [True]


def test_a_load_interrupted_anywhere_leaves_the_state_as_it_was_or_as_loaded():
    import random
    torch.manual_seed(0)
    w, b = nn.Parameter(torch.randn(16, 24)), nn.Parameter(torch.randn(24))
    opt = dion3.Dion3([dict(params=[w]), dict(params=[b], algorithm="adamw")], lr=0.02)

    def steps(n):
        for _ in range(n):
            w.grad, b.grad = torch.randn(16, 24), torch.randn(24)
            opt.step()
    steps(3)
    saved = copy.deepcopy(opt.state_dict())
    steps(2)
    now = copy.deepcopy(opt.state_dict())
    rng = random.Random(0)
    interrupted = 0
    for _ in range(400):
        try:
            with _interrupts(rng.uniform(50e-6, 600e-6)):
                opt.load_state_dict(saved)
        except KeyboardInterrupt:
            interrupted += 1
        sd = opt.state_dict()
        for st, a, c in zip(sd["state"].values(), now["state"].values(), saved["state"].values()):
            assert st.keys() == a.keys()  # as it was (a) or as loaded (c), never a mix or nothing
            assert all(torch.equal(st[k], a[k]) if torch.is_tensor(a[k]) else st[k] == a[k] for k in a) or \
                all(torch.equal(st[k], c[k]) if torch.is_tensor(c[k]) else st[k] == c[k] for k in c)
        opt.load_state_dict(now)
    torch.set_grad_enabled(True)  # as after the steps above
    assert interrupted > 0


def test_parameters_taken_out_of_the_optimizer_are_freed():
    import gc
    import weakref
    w = nn.Parameter(torch.randn(16, 24))
    opt = dion3.Dion3([w], lr=0.02)
    refs = []
    for _ in range(3):
        extra = nn.Parameter(torch.randn(16, 24))
        opt.add_param_group(dict(params=[extra]))
        w.grad, extra.grad = torch.randn(16, 24), torch.randn(16, 24)
        opt.step()
        opt.param_groups.pop()
        del opt.state[extra]
        opt.step()
        refs.append(weakref.ref(extra))
        del extra
    gc.collect()
    assert all(r() is None for r in refs)
