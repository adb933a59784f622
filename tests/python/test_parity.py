# test_parity.py — dion3.Dion3 / NorMuon / Muon (and the AdamW / Lion groups) against the float64
# transcription of docs/algorithm.md in reference.py, over several steps, on every device of conftest.
import copy
import math

import pytest
import torch

import dion3
from reference import Reference, orth_gram, orth_standard, POLAR_EXPRESS

STEPS = 4


def make_params(shapes, device, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device=device, dtype=dtype)) for s in shapes]


def grads_for(shapes, step, seed=100):
    g = torch.Generator().manual_seed(seed + step)
    return [torch.randn(s, generator=g) for s in shapes]


def set_grads(params, grads, device):
    for p, g in zip(params, grads):
        p.grad = g.to(device)


def exact_orth(device):
    """Options that make the CUDA backend orthogonalize in fp32 (its default is fp16/bf16), so
    results can be compared tightly; the CPU backend is fp32 already."""
    return dict(iteration_dtype=torch.float32) if device.type == "cuda" else {}


def run_pair(cls, shapes, device, group_opts, ctor=None, ref_opts=None, steps=STEPS, atol=None):
    """Step our optimizer and the reference with the same gradients; compare weights each step."""
    if atol is None:
        atol = 2e-5 if device.type == "cpu" else 1e-4  # GPU fp32 GEMMs may round differently
    params = make_params(shapes, device)
    ref = Reference(params, **dict(group_opts, **(ref_opts or {})))
    kw = dict(ctor or {})
    if device.type == "cuda" and "iteration_dtype" not in kw:
        kw["iteration_dtype"] = torch.float32
    opt = cls([dict(params=params, **group_opts)], **kw)
    for t in range(steps):
        gs = grads_for(shapes, t)
        set_grads(params, gs, device)
        opt.step()
        ref.step(gs)
        for i, (p, w) in enumerate(zip(params, ref.w)):
            got = p.detach().double().cpu()
            err = (got - w).abs().max().item()
            assert err <= atol, f"step {t} param {i} {tuple(p.shape)}: max |ours - reference| = {err:.3g}"
    return opt, ref, params


SHAPES = [(32, 16), (16, 48), (24, 24), (3, 8, 12)]


@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0])
def test_dion3_matches_reference(device, fraction):
    run_pair(dion3.Dion3, SHAPES, device, dict(algorithm="dion3", lr=0.02, fraction=fraction, weight_decay=0.1))


@pytest.mark.parametrize("orthogonalizer", ["standard", "gram", "auto"])
def test_dion3_orthogonalizers_match_reference(device, orthogonalizer):
    run_pair(dion3.Dion3, [(16, 64), (64, 16)], device, dict(lr=0.02, fraction=0.5),
             ctor=dict(orthogonalizer=orthogonalizer))


def test_dion3_flatten_and_state(device):
    shapes = [(6, 4, 5), (10, 3, 3)]
    opt, ref, params = run_pair(dion3.Dion3, shapes, device, dict(lr=0.01, fraction=0.5, flatten=True))
    for p, st in zip(params, ref.state):
        mine = opt.state[p]
        assert mine["step"] == STEPS
        assert torch.allclose(mine["momentum"].double().cpu(), st["momentum"].reshape(p.shape), atol=1e-5)
        # flatten=True: one value per output channel, as (channels, 1)
        assert mine["variance_neuron"].shape == (p.shape[0], 1)
        assert torch.allclose(mine["variance_neuron"].double().cpu(), st["variance"].reshape(-1, 1), rtol=1e-4,
                              atol=1e-9)
        assert mine["variance_neuron"].dtype == torch.float32


@pytest.mark.parametrize("adjust_lr", ["spectral_norm", "rms_norm", None])
def test_adjust_lr_rules(device, adjust_lr):
    run_pair(dion3.Dion3, [(32, 8), (8, 32)], device, dict(lr=0.01, adjust_lr=adjust_lr))


def test_scale_lr_by_fraction_and_you_coefficients(device):
    run_pair(dion3.Dion3, [(32, 16)], device, dict(lr=0.01, fraction=0.25, scale_lr_by_fraction=True,
                                                  use_polar_express=False))


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("cautious_wd", [False, True])
def test_normuon_matches_reference(device, nesterov, cautious_wd):
    run_pair(dion3.NorMuon, SHAPES, device,
             dict(algorithm="normuon", lr=0.02, nesterov=nesterov, cautious_wd=cautious_wd, weight_decay=0.2))


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("cautious_wd", [False, True])
def test_muon_matches_reference(device, nesterov, cautious_wd):
    run_pair(dion3.Muon, SHAPES, device,
             dict(algorithm="muon", lr=0.02, nesterov=nesterov, cautious_wd=cautious_wd, weight_decay=0.2))


def test_dion3_fraction_one_is_normuon(device):
    shapes = [(16, 24), (24, 16)]
    pa, pb = make_params(shapes, device), make_params(shapes, device)
    a = dion3.Dion3(pa, fraction=1.0, lr=0.03, **exact_orth(device))
    b = dion3.NorMuon(pb, lr=0.03, **exact_orth(device))
    for t in range(STEPS):
        for ps in (pa, pb):
            set_grads(ps, grads_for(shapes, t), device)
        a.step()
        b.step()
    for x, y in zip(pa, pb):
        assert torch.allclose(x, y, atol=1e-6)


def test_unselected_rows_change_only_by_weight_decay(device):
    (p,) = make_params([(40, 12)], device)
    w0 = p.detach().clone()
    opt = dion3.Dion3([p], fraction=0.25, lr=0.05, weight_decay=0.1)
    g = torch.zeros(40, 12)
    g[:5] = torch.randn(5, 12)  # only rows 0..4 can score; k = 10, so rows 5.. include unselected ones
    g[5:10] = 1e-3
    p.grad = g.to(device)
    opt.step()
    changed = ~torch.isclose(p.detach(), w0 * (1 - 0.05 * 0.1), rtol=0, atol=1e-7)
    rows = changed.any(dim=1).nonzero().flatten().tolist()
    assert set(rows) <= set(range(10)) and len(rows) > 0


def test_adamw_matches_torch(device):
    shapes = [(7,), (5, 3)]
    pa, pb = make_params(shapes, device), make_params(shapes, device)
    ours = dion3.Dion3([dict(params=pa, algorithm="adamw", lr=1e-2, weight_decay=0.1)])
    theirs = torch.optim.AdamW(pb, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for t in range(STEPS + 2):
        for ps in (pa, pb):
            set_grads(ps, grads_for(shapes, t), device)
        ours.step()
        theirs.step()
        for x, y in zip(pa, pb):
            assert torch.allclose(x, y, atol=1e-6, rtol=1e-5), f"step {t}"
    assert torch.allclose(ours.state[pa[0]]["variance"], theirs.state[pb[0]]["exp_avg_sq"], rtol=1e-5)


def test_adamw_matches_torch_on_large_finite_gradients(device):
    # v / (1 - beta2^t) overflows float32 from |g| ~ 1.8e19; torch's one-tensor AdamW divides
    # sqrt(v) instead and moves such elements by lr like any other. (Its multi-tensor AdamW, the
    # default for CUDA tensors, divides v and leaves them where they are: the reference is on the CPU.)
    g = torch.tensor([1.0, -1e10, 1e19, -2e19, 3e19, -4e19] * 3)  # v stays finite over the 3 steps
    pa = torch.nn.Parameter(torch.full((18,), 0.5, device=device))
    pb = torch.nn.Parameter(torch.full((18,), 0.5))
    ours = dion3.Dion3([dict(params=[pa], algorithm="adamw", lr=1e-2, weight_decay=0.0)])
    theirs = torch.optim.AdamW([pb], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, foreach=False)
    for t in range(3):
        pa.grad, pb.grad = g.to(device) * (-1) ** t, g * (-1) ** t
        ours.step()
        theirs.step()
        assert torch.allclose(pa.cpu(), pb, atol=1e-6, rtol=1e-5), f"step {t}: {pa.tolist()} vs {pb.tolist()}"


def test_adamw_and_lion_match_reference(device):
    run_pair(dion3.Dion3, [(9,), (4, 4)], device, dict(algorithm="adamw", lr=3e-3, betas=(0.8, 0.99)))
    run_pair(dion3.Dion3, [(9,), (4, 4)], device, dict(algorithm="lion", lr=3e-3, betas=(0.9, 0.99)))


def test_mixed_groups_in_one_optimizer(device):
    shapes_m, shapes_v = [(12, 8), (8, 12)], [(8,), (12,)]
    pm, pv = make_params(shapes_m, device, seed=1), make_params(shapes_v, device, seed=2)
    rm, rv = Reference(pm, lr=0.02), Reference(pv, algorithm="lion", lr=1e-3)
    opt = dion3.Dion3([dict(params=pm), dict(params=pv, algorithm="lion", lr=1e-3)], lr=0.02, **exact_orth(device))
    for t in range(STEPS):
        gm, gv = grads_for(shapes_m, t), grads_for(shapes_v, t, seed=7)
        set_grads(pm + pv, gm + gv, device)
        opt.step()
        rm.step(gm)
        rv.step(gv)
    for p, w in zip(pm + pv, rm.w + rv.w):
        assert torch.allclose(p.detach().double().cpu(), w, atol=2e-5 if device.type == "cpu" else 1e-4)


def test_reference_gram_equals_standard():
    # Sanity of the transcription itself: both orthogonalizers agree in float64.
    g = torch.Generator().manual_seed(3)
    for shape in [(8, 32), (32, 8), (16, 16)]:
        X = torch.randn(shape, generator=g, dtype=torch.float64)
        assert torch.allclose(orth_standard(X), orth_gram(X), atol=1e-9)
        s = torch.linalg.svdvals(orth_standard(X, POLAR_EXPRESS))
        assert s.min() > 0.6 and s.max() < 1.25


def test_bf16_params_with_fp32_momentum(device):
    shapes = [(16, 32)]
    params = make_params(shapes, device, dtype=torch.bfloat16)
    ref = Reference(params, lr=0.02)
    opt = dion3.Dion3(params, lr=0.02, momentum_dtype=torch.float32, **exact_orth(device))
    for t in range(2):
        gs = grads_for(shapes, t)
        params[0].grad = gs[0].to(device=device, dtype=torch.bfloat16)
        ref.step([g.bfloat16() for g in gs])
        opt.step()
    assert opt.state[params[0]]["momentum"].dtype == torch.float32
    # bf16 weights: compare at bf16 resolution.
    assert torch.allclose(params[0].double().cpu(), ref.w[0], atol=3e-2)


@pytest.mark.parametrize("cls,algo", [(dion3.Dion3, "dion3"), (dion3.NorMuon, "normuon"), (dion3.Muon, "muon")])
def test_default_iteration_dtype_close_to_reference(device, cls, algo):
    # The backend's own iteration dtype (CPU: fp32; CUDA: fp16 Gram / bf16 standard NS): close to
    # the float64 reference at that dtype's resolution.
    atol = 2e-5 if device.type == "cpu" else 3e-3
    run_pair(cls, [(64, 32), (32, 96)], device, dict(algorithm=algo, lr=0.02), ctor=dict(iteration_dtype=None),
             atol=atol)


def test_small_workspace_limit_gives_the_same_result(device):
    # A tiny budget makes the engine orthogonalize each megabatch one matrix at a time.
    shapes = [(24, 16)] * 5
    pa, pb = make_params(shapes, device), make_params(shapes, device)
    a = dion3.Dion3(pa, workspace_limit=1, **exact_orth(device))
    b = dion3.Dion3(pb, **exact_orth(device))
    for t in range(3):
        for ps in (pa, pb):
            set_grads(ps, grads_for(shapes, t), device)
        a.step()
        b.step()
    for x, y in zip(pa, pb):
        assert torch.allclose(x, y, atol=1e-6)


def test_expert_stacks_are_separate_matrices_megabatched_with_their_shape(device):
    # [E, m, n] with flatten=False: E matrices, each its own top rows, lr adjustment and NorMuon
    # rescale (the reference steps them one by one), in one megabatch with a 2-D weight of the
    # same shape from another layer.
    shapes = [(4, 16, 24), (16, 24), (2, 24, 16)]
    opt, _, _ = run_pair(dion3.Dion3, shapes, device, dict(lr=0.02, fraction=0.25, weight_decay=0.1))
    counts = {(mb["rows"], mb["cols"]): mb["count"] for mb in opt.plan()}
    assert counts[(16, 24)] == 5 and counts[(24, 16)] == 2, opt.plan()


def test_parameters_without_a_gradient_keep_weights_and_state(device):
    # An expert that got no tokens this step (grad None) is left alone, its state kept and saved.
    params = make_params([(16, 24), (16, 24), (8,)], device)
    opt = dion3.Dion3([dict(params=params[:2], param_names=["expert0", "expert1"]),
                       dict(params=params[2:], algorithm="adamw", param_names=["bias"])], lr=0.02)
    set_grads(params, grads_for([(16, 24), (16, 24), (8,)], 0), device)
    opt.step()
    frozen = params[1]
    w_before = frozen.detach().clone()
    st_before = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[frozen].items()}
    for t in range(1, 3):
        frozen.grad = None
        set_grads([params[0], params[2]], [g for i, g in enumerate(grads_for([(16, 24), (16, 24), (8,)], t)) if i != 1],
                  device)
        opt.step()
    assert torch.equal(frozen.detach(), w_before)
    for k, v in opt.state[frozen].items():
        assert (torch.equal(v, st_before[k]) if torch.is_tensor(v) else v == st_before[k]), k
    saved = opt.state_dict()["state"]
    assert set(saved[1]) >= {"momentum", "variance_neuron", "step"} and saved[1]["step"] == 1
    assert saved[0]["step"] == 3


@pytest.mark.parametrize("make", [lambda ps: dion3.Dion3(ps, lr=0.02, weight_decay=0.1),
                                  lambda ps: dion3.optim.Muon(ps, lr=0.02),
                                  lambda ps: dion3.Dion3([dict(params=ps, algorithm="adamw")], lr=0.01)],
                         ids=["dion3", "torch_muon", "adamw"])
def test_a_frozen_parameter_holds_no_state_until_it_steps(device, make):
    # requires_grad=False: no state at construction, none saved or made by a load (torch.optim
    # and torch.distributed.checkpoint keep none either); unfrozen, it starts from zero state at
    # its first step, as in an optimizer made then.
    shapes = [(16, 24), (16, 24)]
    params = make_params(shapes, device)
    params[1].requires_grad_(False)
    opt = make(params)
    assert params[0] in opt.state and params[1] not in opt.state
    for t in range(2):
        set_grads(params[:1], grads_for(shapes, t)[:1], device)
        opt.step()
    sd = opt.state_dict()
    sd_frozen = copy.deepcopy(sd)  # torch's state_dict holds the live per-parameter dicts
    assert sorted(sd["state"]) == [0]
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh[1].requires_grad_(False)
    opt2 = make(fresh)
    opt2.load_state_dict(sd)
    assert fresh[1] not in opt2.state
    # Unfrozen: compared with an optimizer made for that parameter alone at that point.
    params[1].requires_grad_(True)
    alone = [torch.nn.Parameter(params[1].detach().clone())]
    opt_alone = make(alone)
    for t in range(2, 4):
        g = grads_for(shapes, t)
        set_grads(params, g, device)
        set_grads(alone, g[1:], device)
        opt.step()
        opt_alone.step()
    assert opt.state[params[1]]["step"] == 2 and opt.state[params[0]]["step"] == 4
    assert torch.allclose(params[1].detach(), alone[0].detach(), rtol=0, atol=1e-6)
    # A checkpoint saved while it was frozen loads into an optimizer where it trains: it starts
    # afresh there (as in torch.optim), the others resume.
    fresh[1].requires_grad_(True)
    opt3 = make(fresh)
    opt3.load_state_dict(sd_frozen)
    assert opt3.state[fresh[1]]["step"] == 0 and opt3.state[fresh[0]]["step"] == 2
    assert all(not torch.is_tensor(v) or not v.any() for v in opt3.state[fresh[1]].values())
    # A checkpoint with state for a parameter frozen since is loaded whole.
    fresh[1].requires_grad_(False)
    sd = opt.state_dict()
    opt2.load_state_dict(sd)
    assert opt2.state[fresh[1]]["step"] == 2
    assert all(torch.equal(a, b) for k, a in opt2.state[fresh[1]].items() if torch.is_tensor(a)
               for b in [opt.state[params[1]][k]])


# tall, wide, square, tall and wide stacks; 200x70 spans several row chunks and column tiles of the CUDA kernels
DION2_SHAPES = [(32, 16), (16, 48), (24, 24), (2, 20, 8), (3, 8, 12), (200, 70)]


@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0])
def test_dion2_matches_reference_tall_matrices_by_columns(device, fraction):
    opt, _, _ = run_pair(dion3.Dion2, DION2_SHAPES, device, dict(lr=0.02, fraction=fraction, ef_decay=0.9),
                         ref_opts=dict(algorithm="dion2", mu=0.9))
    by_columns = {(mb["rows"], mb["cols"]): mb["columns"] for mb in opt.plan()}
    assert by_columns[(16, 32)] and by_columns[(8, 20)]  # the tall ones, transposed
    assert not by_columns[(16, 48)] and not by_columns[(24, 24)] and not by_columns[(8, 12)]
    state = opt.state_dict()
    assert all(set(s) == {"momentum", "step"} for s in state["state"].values())  # no NorMuon variance
    assert state["param_groups"][0]["algorithm"] == "dion2" and state["param_groups"][0]["ef_decay"] == 0.9


def test_dion2_cautious_decay_and_a_dion2_group_in_dion3(device):
    # A dion2 group inside a Dion3 optimizer reads its decay from mu.
    run_pair(dion3.Dion3, DION2_SHAPES[:2], device, dict(algorithm="dion2", lr=0.02, fraction=0.5, mu=0.8,
                                                        cautious_wd=True, weight_decay=0.1))


def test_nordion2_is_dion3(device):
    a, b = make_params(SHAPES, device), make_params(SHAPES, device)
    oa, ob = dion3.Dion3(a, lr=0.02), dion3.NorDion2(b, lr=0.02)
    for t in range(3):
        gs = grads_for(SHAPES, t)
        set_grads(a, gs, device)
        set_grads(b, gs, device)
        oa.step()
        ob.step()
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert ob.state_dict()["param_groups"][0]["algorithm"] == "nordion2"


def test_dion2_names_its_decay_ef_decay_and_dion3_mu():
    p = torch.nn.Parameter(torch.randn(8, 4))
    with pytest.raises(ValueError, match="unknown setting 'mu'; dion3 calls it 'ef_decay'"):
        dion3.Dion2([dict(params=[p], mu=0.9)])
    with pytest.raises(ValueError, match="unknown setting 'ef_decay'; dion3 calls it 'mu'"):
        dion3.Dion3([dict(params=[p], ef_decay=0.9)])
    with pytest.raises(ValueError, match="unknown setting 'momentum'; dion3 calls it 'ef_decay'"):
        dion3.Dion2([dict(params=[p], momentum=0.9)])  # torch's name, through mu
    with pytest.raises(ValueError, match="not available for dion2"):
        dion3.Dion2([dict(params=[p], split_sizes=[4, 4])])
