# test_checkpoint_format.py — checkpoints move between dion3 and the reference package (the public
# `dion` optimizers) with no conversion. The reference side is a transcription kept here: the
# float64 optimizer of reference.py, saving and loading a torch state_dict in the reference's
# layout, which is (facts of its public optimizer files):
#   - groups: every constructor default (lr, fraction, mu, muon_beta2, beta1, beta2, weight_decay,
#     epsilon, flatten, adjust_lr, selection_scope, ...), "algorithm" ("nordion2" for Dion3, which
#     is an alias of NorDion2 there; "normuon", "muon", "adamw", "lion") and "step", an int every
#     step() adds one to; AdamW's bias correction reads the group's step;
#   - state per parameter, no step of its own: "momentum" (the parameter's shape and dtype), for
#     NorMuon / NorDion2 "variance_neuron" = zeros_like(p[..., 0:1]) (one value per row, the
#     parameter's dtype), for AdamW "momentum" and "variance";
#   - loading is torch's: groups replaced, floating state cast to the parameter's dtype.
import copy

import pytest
import torch

import dion3
from reference import Reference
from test_parity import exact_orth, grads_for, make_params

MATS = [(16, 24), (24, 16), (2, 8, 12)]
VECS = [(24,)]
GROUP = dict(lr=0.02, fraction=0.5, weight_decay=0.1)
ADAMW = dict(algorithm="adamw", lr=0.01, weight_decay=0.01)


def _atol(device):
    return 2e-5 if device.type == "cpu" else 1e-4


def ref_state_dict(groups):
    """The reference's state_dict of [(Reference, params, algorithm)]; ids count across groups."""
    state, param_groups, pid = {}, [], 0
    for ref, params, algorithm in groups:
        o = ref.opts
        g = dict(lr=o["lr"], fraction=o["fraction"], mu=o["mu"], muon_beta2=o["muon_beta2"], beta1=o["betas"][0],
                 beta2=o["betas"][1], weight_decay=o["weight_decay"], epsilon=o["epsilon"], flatten=o["flatten"],
                 adjust_lr=o["adjust_lr"], selection_scope="global", algorithm=algorithm,
                 step=max(st["step"] for st in ref.state), params=[])
        for p, st in zip(params, ref.state):
            if algorithm == "adamw":
                s = dict(momentum=st["exp_avg"].to(p.dtype), variance=st["exp_avg_sq"].to(p.dtype))
            else:
                s = dict(momentum=st["momentum"].reshape(p.shape).to(p.dtype))
                if algorithm != "muon":
                    s["variance_neuron"] = st["variance"].reshape(tuple(p.shape[:-1]) + (1,)).to(p.dtype)
            state[pid] = s
            g["params"].append(pid)
            pid += 1
        param_groups.append(g)
    return dict(state=state, param_groups=param_groups)


def ref_load_state_dict(groups, sd):
    """The reference's load of sd into [(Reference, params, algorithm)], reading only what it reads."""
    for (ref, params, algorithm), g in zip(groups, sd["param_groups"]):
        assert g["algorithm"] == algorithm
        ref.opts.update(lr=g["lr"], weight_decay=g["weight_decay"], betas=(g["beta1"], g["beta2"]), mu=g["mu"],
                        muon_beta2=g["muon_beta2"], epsilon=g["epsilon"], fraction=g["fraction"])
        for i, (p, pid) in enumerate(zip(params, g["params"])):
            s = {k: v.to(p.dtype) for k, v in sd["state"][pid].items() if torch.is_tensor(v)}  # torch's cast
            st = ref.state[i]
            st["step"] = g["step"]
            ref.w[i] = p.detach().double().cpu().clone()
            if algorithm == "adamw":
                st["exp_avg"], st["exp_avg_sq"] = s["momentum"].double().cpu(), s["variance"].double().cpu()
                continue
            count = p.numel() // (p.shape[-2] * p.shape[-1])
            st["momentum"] = s["momentum"].double().cpu().reshape(count, p.shape[-2], p.shape[-1])
            st["variance"] = s["variance_neuron"].double().cpu().reshape(count, p.shape[-2])


def _step_both(opt, groups, params, steps, first):
    shapes = [tuple(p.shape) for p in params]
    for t in range(first, first + steps):
        gs = grads_for(shapes, t)
        for p, g in zip(params, gs):
            p.grad = g.to(device=p.device, dtype=p.dtype)
        if opt is not None:
            opt.step()
        i = 0
        for ref, ps, _ in groups:
            ref.step(gs[i:i + len(ps)])
            i += len(ps)


def _compare_weights(groups, params, atol):
    refs = [w for ref, _, _ in groups for w in ref.w]
    for p, w in zip(params, refs):
        err = (p.detach().double().cpu() - w).abs().max().item()
        assert err <= atol, f"{tuple(p.shape)}: max |dion3 - reference| = {err:.3g}"


def _references(pm, pv):
    return [(Reference(pm, algorithm="dion3", **GROUP), pm, "nordion2"), (Reference(pv, **ADAMW), pv, "adamw")]


def _setup(device):
    pm, pv = make_params(MATS, device), make_params(VECS, device, seed=1)
    return pm, pv, _references(pm, pv)


def _dion3(pm, pv, device):
    return dion3.Dion3([dict(params=pm, **GROUP), dict(params=pv, **ADAMW)], **exact_orth(device))


def test_a_reference_checkpoint_resumes_in_dion3(device):
    pm, pv, groups = _setup(device)
    _step_both(None, groups, pm + pv, 3, 0)  # the reference alone
    sd = ref_state_dict(groups)
    for p, w in zip(pm + pv, [w for r, _, _ in groups for w in r.w]):
        with torch.no_grad():
            p.copy_(w)
    opt = _dion3(pm, pv, device)
    opt.load_state_dict(copy.deepcopy(sd))
    assert [g["algorithm"] for g in opt.param_groups] == ["dion3", "adamw"]
    for p, pid in zip(pm + pv, range(4)):
        assert opt.state[p]["step"] == 3  # the group's counter: the reference keeps no other
        for k, v in sd["state"][pid].items():
            assert torch.equal(opt.state[p][k].cpu(), v.to(opt.state[p][k].dtype))
    _step_both(opt, groups, pm + pv, 2, 3)
    _compare_weights(groups, pm + pv, _atol(device))


def test_a_dion3_checkpoint_resumes_in_the_reference(device):
    pm, pv, groups = _setup(device)
    opt = _dion3(pm, pv, device)
    _step_both(opt, groups, pm + pv, 3, 0)
    sd = opt.state_dict()
    g0, g1 = sd["param_groups"]
    assert (g0["algorithm"], g1["algorithm"]) == ("nordion2", "adamw")
    assert (g0["beta1"], g0["beta2"]) == tuple(g0["betas"]) and g0["step"] == g1["step"] == 3
    for pid, p in enumerate(pm):
        assert set(sd["state"][pid]) == {"momentum", "variance_neuron", "step"}
        assert sd["state"][pid]["variance_neuron"].shape == tuple(p.shape[:-1]) + (1,)
        assert sd["state"][pid]["variance_neuron"].dtype == torch.float32
    assert set(sd["state"][3]) == {"momentum", "variance", "step"}
    # A fresh reference run takes the checkpoint and the weights and goes on.
    fresh = _references(pm, pv)
    ref_load_state_dict(fresh, sd)
    _compare_weights(fresh, pm + pv, 0.0)
    _step_both(opt, fresh, pm + pv, 2, 3)
    _compare_weights(fresh, pm + pv, _atol(device))


def _old_layout(sd):
    """sd as dion3 wrote it before it took the reference's layout."""
    old = copy.deepcopy(sd)
    for g in old["param_groups"]:
        g["algorithm"] = "dion3" if g["algorithm"] == "nordion2" else g["algorithm"]
        for k in ("beta1", "beta2", "step"):
            g.pop(k)
        for pid in g["params"]:
            st = old["state"][pid]
            if g["algorithm"] == "adamw":
                st["exp_avg"], st["exp_avg_sq"] = st.pop("momentum"), st.pop("variance")
            else:
                st["variance"] = st.pop("variance_neuron").reshape(-1)
    return old


def test_checkpoints_of_earlier_dion3_versions_still_load(device):
    pm, pv, groups = _setup(device)
    opt = _dion3(pm, pv, device)
    _step_both(opt, groups, pm + pv, 2, 0)
    sd = opt.state_dict()
    loaded = []
    for form in (sd, _old_layout(sd)):
        qm, qv = [torch.nn.Parameter(p.detach().clone()) for p in pm], [torch.nn.Parameter(p.detach().clone()) for p in pv]
        o = _dion3(qm, qv, device)
        o.load_state_dict(form)
        loaded.append(o.state_dict())
    new, old = loaded
    for pid in new["state"]:
        assert new["state"][pid].keys() == old["state"][pid].keys()
        for k, v in new["state"][pid].items():
            assert torch.equal(v, old["state"][pid][k]) if torch.is_tensor(v) else v == old["state"][pid][k], k


def test_a_reference_checkpoint_of_bfloat16_weights_keeps_float32_variance_here(device):
    pm, pv, groups = _setup(device)
    pm = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in pm]
    groups[0] = (groups[0][0], pm, "nordion2")
    _step_both(None, groups, pm + pv, 2, 0)
    sd = ref_state_dict(groups)
    assert sd["state"][0]["variance_neuron"].dtype == torch.bfloat16
    opt = _dion3(pm, pv, device)
    opt.load_state_dict(sd)
    st = opt.state[pm[0]]
    assert st["variance_neuron"].dtype == torch.float32 and st["momentum"].dtype == torch.bfloat16
    assert torch.equal(st["variance_neuron"].cpu(), sd["state"][0]["variance_neuron"].float())
    for p in pm + pv:
        p.grad = torch.randn_like(p)
    opt.step()


@pytest.mark.parametrize("shape", [(6, 5, 4, 3)])
def test_flattened_conv_weights_say_how_their_variance_differs(device, shape):
    # flatten=True: dion3 normalises per output channel, (C, 1); the reference per last-dimension
    # row, p[..., 0:1]. Loading the reference's shape is refused with both shapes named.
    (p,) = make_params([shape], device)
    opt = dion3.Dion3([p], flatten=True)
    sd = opt.state_dict()
    assert sd["state"][0]["variance_neuron"].shape == (shape[0], 1)
    sd["state"][0]["variance_neuron"] = torch.zeros(shape[:-1] + (1,))
    with pytest.raises(ValueError, match=r"state 'variance_neuron' has shape \[6, 5, 4, 1\], expected \[6, 1\]"):
        opt.load_state_dict(sd)


def test_a_group_switched_to_another_kind_of_algorithm_starts_its_state_afresh(device):
    # Matrix and AdamW state share the name "momentum" but not its meaning.
    (p,) = make_params([(8, 6)], device)
    opt = dion3.Dion3([dict(params=[p], algorithm="muon", lr=0.02)])
    for _ in range(2):
        p.grad = torch.randn_like(p)
        opt.step()
    q = torch.nn.Parameter(p.detach().clone())
    fresh = dion3.Dion3([dict(params=[q], algorithm="adamw", lr=0.01)])
    opt.param_groups[0].update(algorithm="adamw", lr=0.01)
    g = torch.randn_like(p)
    p.grad, q.grad = g.clone(), g.clone()
    opt.step()
    fresh.step()
    assert torch.equal(p, q)
    assert set(opt.state[p]) == {"momentum", "variance", "step"} and opt.state[p]["step"] == 1


def test_state_placements_follow_the_parameter_and_the_variance_keeps_row_shards():
    from torch.distributed.tensor import Replicate, Shard
    from dion3 import distributed as d
    assert d._placements_for((1,), (Shard(0),), (1,)) == (Shard(0),)          # a (1,) gate under FSDP2
    assert d._placements_for((8, 4), (Shard(1),), (8, 4)) == (Shard(1),)       # momentum of a column shard
    assert d._placements_for((8, 1), (Shard(1),), (8, 4)) == (Replicate(),)    # its variance: every row
    assert d._placements_for((8, 1), (Shard(0),), (8, 4)) == (Shard(0),)       # row shards stay
    assert d._placements_for((6, 1), (Shard(2),), (6, 5, 4, 3)) == (Replicate(),)  # flatten=True conv


def test_dion2_checkpoints_move_both_ways(device):
    # The reference's Dion2 groups name the error-feedback decay "ef_decay" and keep no variance.
    pm = make_params(MATS, device)  # wide, tall (by columns) and a stack
    ref = Reference(pm, algorithm="dion2", mu=0.9, **GROUP)
    _step_both(None, [(ref, pm, "dion2")], pm, 3, 0)
    sd = dict(state={i: dict(momentum=st["momentum"].reshape(p.shape).to(p.dtype))
                     for i, (p, st) in enumerate(zip(pm, ref.state))},
              param_groups=[dict(lr=GROUP["lr"], ef_decay=0.9, fraction=GROUP["fraction"], beta1=0.9, beta2=0.95,
                                 weight_decay=GROUP["weight_decay"], epsilon=1e-8, flatten=False,
                                 adjust_lr="spectral_norm", algorithm="dion2", step=3, params=[0, 1, 2])])
    for p, w in zip(pm, ref.w):
        with torch.no_grad():
            p.copy_(w)
    opt = dion3.Dion2(pm, lr=0.5, ef_decay=0.5, **exact_orth(device))  # every setting comes from the checkpoint
    opt.load_state_dict(copy.deepcopy(sd))
    _step_both(opt, [(ref, pm, "dion2")], pm, 2, 3)
    _compare_weights([(ref, pm, "dion2")], pm, _atol(device))
    out = opt.state_dict()
    g = out["param_groups"][0]
    assert (g["algorithm"], g["ef_decay"], g["step"]) == ("dion2", 0.9, 5)
    assert all(set(s) == {"momentum", "step"} for s in out["state"].values())
    for i, p in enumerate(pm):  # the reference's momentum layout: the parameter's shape
        assert out["state"][i]["momentum"].shape == p.shape


@pytest.mark.parametrize("frm,to", [("adamw", "lion"), ("dion3", "lion"), ("lion", "adamw"), ("dion3", "adamw")])
def test_a_checkpoint_after_an_algorithm_switch_resumes_exactly(frm, to):
    # The switched group's parameters start afresh at their next step; a checkpoint (or a copy)
    # taken between the switch and that step must say so, not carry the old kind's moments.
    import io

    def params(seed):
        g = torch.Generator().manual_seed(seed)
        return [torch.nn.Parameter(torch.randn(8, 8, generator=g))]

    def grad(ps, t):
        g = torch.Generator().manual_seed(100 + t)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)

    ps = params(0)
    opt = dion3.Dion3([dict(params=ps, algorithm=frm)], lr=0.01)
    for t in range(3):
        grad(ps, t)
        opt.step()
    opt.param_groups[0]["algorithm"] = to
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    saved_w = ps[0].detach().clone()
    cp = copy.deepcopy(opt)
    for t in range(3, 6):
        grad(ps, t)
        opt.step()
    qs = params(9)
    resumed = dion3.Dion3([dict(params=qs, algorithm=frm)], lr=0.01)
    with torch.no_grad():
        qs[0].copy_(saved_w)
    buf.seek(0)
    resumed.load_state_dict(torch.load(buf, weights_only=False))
    cps = cp.param_groups[0]["params"]
    for t in range(3, 6):
        grad(qs, t)
        resumed.step()
        grad(cps, t)
        cp.step()
    assert torch.equal(ps[0], qs[0]) and torch.equal(ps[0], cps[0])


@pytest.mark.parametrize("frm,to", [("dion3", "adamw"), ("adamw", "lion"), ("muon", "lion"), ("lion", "normuon")])
def test_a_copied_optimizer_tells_a_later_switch_of_algorithm(frm, to):
    # A deepcopy or an unpickled copy knows which kind of algorithm its state was made for: a
    # switch after the copy starts the state afresh there too, not reading one kind's moments as
    # another's.
    import io
    g0 = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(8, 6, generator=g0))]
    opt = dion3.Dion3([dict(params=ps, algorithm=frm)], lr=0.01)
    for t in range(2):
        ps[0].grad = torch.randn(8, 6, generator=torch.Generator().manual_seed(t))
        opt.step()
    copied = copy.deepcopy((ps, opt))
    buf = io.BytesIO()
    torch.save((ps, opt), buf)
    buf.seek(0)
    pickled = torch.load(buf, weights_only=False)
    runs = [(ps, opt), copied, pickled]
    for qs, o in runs:
        o.param_groups[0]["algorithm"] = to
        for t in range(2, 4):
            qs[0].grad = torch.randn(8, 6, generator=torch.Generator().manual_seed(t))
            o.step()
    for qs, o in runs[1:]:
        assert torch.equal(qs[0], ps[0])
        assert set(o.state[qs[0]]) == set(opt.state[ps[0]])


@pytest.mark.parametrize("left_alone", ["no gradient", "frozen"])
def test_a_checkpoint_while_a_switch_waits_for_a_parameter_resumes_exactly(left_alone):
    # A group switched to another kind of algorithm starts all its parameters afresh at its next
    # step, those the step leaves alone (no gradient, frozen with state) too: what a checkpoint
    # taken before that step holds, so a resumed run switched back matches the uninterrupted one.
    def grad(s, i, shape):
        return torch.randn(shape, generator=torch.Generator().manual_seed(100 * s + i))

    def run(resume):
        g0 = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(8, 6, generator=g0)), torch.nn.Parameter(torch.randn(6, 4, generator=g0))]
        opt = dion3.Dion3([dict(params=ps)], lr=0.01)
        for s in range(3):
            for i, p in enumerate(ps):
                p.grad = grad(s, i, p.shape)
            opt.step()
        opt.param_groups[0]["algorithm"] = "adamw"
        if left_alone == "frozen":
            ps[0].requires_grad_(False)
        if resume:
            sd = opt.state_dict()
            ps = [torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) for p in ps]
            opt = dion3.Dion3([dict(params=ps)], lr=0.01)
            opt.load_state_dict(sd)
        ps[0].grad, ps[1].grad = None, grad(3, 1, ps[1].shape)  # the AdamW step leaves ps[0] alone
        opt.step()
        opt.param_groups[0]["algorithm"] = "dion3"
        ps[0].requires_grad_(True)
        for s in (4, 5):
            for i, p in enumerate(ps):
                p.grad = grad(s, i, p.shape)
            opt.step()
        return ps, opt

    (a, oa), (b, ob) = run(False), run(True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert oa.state[a[0]]["step"] == ob.state[b[0]]["step"] == 2  # afresh at the switch back
    assert torch.equal(oa.state[a[0]]["momentum"], ob.state[b[0]]["momentum"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("path", ["muon, dion3 | dion3", "dion3, muon | muon, dion3"])
def test_a_checkpoint_within_matrix_algorithms_resumes_exactly(path, dtype):
    # Switches among the matrix algorithms keep the state: muon -> dion3 adds a variance that starts
    # at zero (a checkpoint taken before the next step must carry it, or a fresh optimizer cannot
    # load it), and dion3 -> muon keeps the float32 variance for a switch back, through a checkpoint
    # too (not cast to the weight's dtype, which the next dion3 step would refuse).
    # path: the algorithms stepped (two steps each), | the checkpoint, then those stepped on.
    import io
    before, after = ([a.strip() for a in part.split(",")] for part in path.split("|"))

    def grad(ps, t):
        g = torch.Generator().manual_seed(100 + t)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g).to(dtype)

    g0 = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter((torch.randn(9, 5, generator=g0) * 0.5).to(dtype))]
    opt = dion3.Dion3([dict(params=ps, algorithm=before[0])], lr=0.02)
    t = 0
    for i, algo in enumerate(before):
        opt.param_groups[0]["algorithm"] = algo
        for _ in range(2 if i + 1 < len(before) else 0):
            grad(ps, t)
            opt.step()
            t += 1
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    qs = [torch.nn.Parameter(ps[0].detach().clone())]
    resumed = dion3.Dion3([dict(params=qs, algorithm="muon")], lr=0.02)
    buf.seek(0)
    resumed.load_state_dict(torch.load(buf, weights_only=False))
    for algo in after:
        for o in (opt, resumed):
            o.param_groups[0]["algorithm"] = algo
        for _ in range(2):
            grad(ps, t)
            opt.step()
            grad(qs, t)
            resumed.step()
            t += 1
    assert torch.equal(ps[0], qs[0])
    assert opt.state[ps[0]]["variance_neuron"].dtype == resumed.state[qs[0]]["variance_neuron"].dtype == torch.float32
    assert torch.equal(opt.state[ps[0]]["variance_neuron"], resumed.state[qs[0]]["variance_neuron"])


@pytest.mark.parametrize("which", ["pre", "post"])
def test_load_hooks_run_where_torch_runs_them(which):
    # A pre-hook edits the dict before anything reads it; a post-hook sees (and may edit) the state
    # as loaded, dion3's own state tensors included; neither runs twice.
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(8, 8))]
    opt = dion3.Dion3(ps, lr=0.01)
    for _ in range(3):
        ps[0].grad = torch.randn(8, 8)
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    qs = [torch.nn.Parameter(ps[0].detach().clone())]
    resumed = dion3.Dion3(qs, lr=0.01)
    calls = []
    if which == "pre":
        def hook(o, d):
            calls.append(1)
            d = copy.deepcopy(d)
            for st in d["state"].values():
                st["momentum"] = torch.zeros_like(st["momentum"])
            return d
        resumed.register_load_state_dict_pre_hook(hook)
    else:
        def hook(o):
            calls.append(1)
            for st in o.state.values():
                st["momentum"] = torch.zeros_like(st["momentum"])
        resumed.register_load_state_dict_post_hook(hook)
    resumed.load_state_dict(sd)
    assert calls == [1]
    assert resumed.state[qs[0]]["momentum"].abs().sum() == 0
    assert torch.equal(resumed.state[qs[0]]["variance_neuron"], opt.state[ps[0]]["variance_neuron"])
    assert sd["state"][0]["momentum"].abs().sum() > 0  # the caller's dict is not edited


def test_state_dict_post_hooks_see_the_dict_returned():
    # A post-hook gets the state_dict in the layout state_dict() returns (the reference's names,
    # dion3's counters) and what it returns or edits stays; it runs once.
    ps = [torch.nn.Parameter(torch.randn(8, 8))]
    opt = dion3.Dion3(ps, lr=0.01)
    ps[0].grad = torch.randn(8, 8)
    opt.step()
    seen = []

    def hook(o, d):
        seen.append((d["param_groups"][0]["algorithm"], d["param_groups"][0]["step"], "steps_skipped" in d))
        d["param_groups"][0]["note"] = "mine"
        del d["steps_skipped"]

    opt.register_state_dict_post_hook(hook)
    sd = opt.state_dict()
    assert seen == [("nordion2", 1, True)]
    assert sd["param_groups"][0]["note"] == "mine" and "steps_skipped" not in sd
    opt.register_state_dict_post_hook(lambda o, d: {"replaced": True})
    assert opt.state_dict() == {"replaced": True}


def test_setting_an_adamw_step_restarts_its_bias_correction():
    # torch's AdamW reads state["step"] at every step: set back to 0, the bias correction starts
    # over. dion3 follows it, and a checkpoint taken after the edit resumes as the live run goes.
    torch.manual_seed(0)
    shapes = [(7,), (5, 3)]
    pa = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    pb = [torch.nn.Parameter(p.detach().clone()) for p in pa]
    ours = dion3.Dion3([dict(params=pa, algorithm="adamw", lr=1e-2, weight_decay=0.1)])
    theirs = torch.optim.AdamW(pb, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def step(t, opts_params):
        for opt, ps in opts_params:
            g = torch.Generator().manual_seed(t)
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()

    for t in range(4):
        step(t, [(ours, pa), (theirs, pb)])
    ours.state[pa[0]]["step"] = 0
    theirs.state[pb[0]]["step"] = torch.tensor(0.0)
    step(4, [(ours, pa), (theirs, pb)])
    sd = copy.deepcopy(ours.state_dict())
    assert sd["state"][0]["step"] == 1 and sd["state"][1]["step"] == 5
    qa = [torch.nn.Parameter(p.detach().clone()) for p in pa]
    resumed = dion3.Dion3([dict(params=qa, algorithm="adamw", lr=1e-2, weight_decay=0.1)])
    resumed.load_state_dict(sd)
    for t in range(5, 8):
        step(t, [(ours, pa), (theirs, pb), (resumed, qa)])
        for x, y, z in zip(pa, pb, qa):
            assert torch.allclose(x, y, atol=1e-6, rtol=1e-5), f"step {t}"
            assert torch.equal(x, z), f"step {t}: the resumed run parted from the live one"


@pytest.mark.parametrize("setting", ["flatten", "momentum_dtype"])
def test_structural_settings_follow_until_the_first_step(setting):
    # Set before the first step, the construction-time zeros are made again for it: a checkpoint
    # taken then holds state of the group's shape and loads back.
    value = True if setting == "flatten" else torch.float32
    p = torch.nn.Parameter(torch.randn(8, 4, 3, 3, dtype=torch.bfloat16))
    opt = dion3.Dion3([p], lr=0.01)
    opt.param_groups[0][setting] = value
    sd = opt.state_dict()
    fresh = dion3.Dion3([torch.nn.Parameter(p.detach().clone())], lr=0.01, **{setting: value})
    assert {k: (t.shape, t.dtype) for k, t in sd["state"][0].items() if isinstance(t, torch.Tensor)} == \
        {k: (t.shape, t.dtype) for k, t in fresh.state_dict()["state"][0].items() if isinstance(t, torch.Tensor)}
    opt.load_state_dict(sd)
    p.grad = torch.randn_like(p)
    opt.step()


def test_flatten_set_after_a_step_is_refused_and_momentum_dtype_casts():
    # flatten shapes the state: set after a step, the step is refused naming it, nothing changed.
    # momentum_dtype only types it: either way the momentum is cast, as a state_dict round trip
    # into an optimizer with the new setting would.
    q = torch.nn.Parameter(torch.randn(8, 4, 3, 3, dtype=torch.bfloat16))
    opt = dion3.Dion3([q], lr=0.01)
    q.grad = torch.randn_like(q)
    opt.step()
    before = {k: t.clone() for k, t in opt.state[q].items() if isinstance(t, torch.Tensor)}
    w = q.detach().clone()
    opt.param_groups[0]["flatten"] = True
    with pytest.raises(ValueError, match="asks for .*flatten=True.*cannot change once its state holds values"):
        opt.step()
    assert torch.equal(q, w) and all(torch.equal(opt.state[q][k], t) for k, t in before.items())
    opt.param_groups[0]["flatten"] = False
    for dtype in (torch.float32, None):
        twin = dion3.Dion3([torch.nn.Parameter(q.detach().clone())], lr=0.01, momentum_dtype=dtype)
        sd = copy.deepcopy(opt.state_dict())  # what the twin loads: the new setting, its momentum cast
        sd["param_groups"][0]["momentum_dtype"] = dtype
        sd["state"][0]["momentum"] = sd["state"][0]["momentum"].to(dtype or torch.bfloat16)
        twin.load_state_dict(sd)
        opt.param_groups[0]["momentum_dtype"] = dtype
        g = torch.randn_like(q)
        q.grad, twin.param_groups[0]["params"][0].grad = g, g.clone()
        opt.step()
        twin.step()
        assert opt.state[q]["momentum"].dtype == (dtype or torch.bfloat16)
        assert torch.equal(q, twin.param_groups[0]["params"][0])


def test_a_non_contiguous_state_tensor_loads_and_resumes(device):
    # A state_dict whose momentum is laid out column-major (a transposed copy, as some checkpoint
    # tools write): the load copies it into the layout the engine steps, and the run resumes.
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(16, 8, device=device))
    q = torch.nn.Parameter(p.detach().clone())
    a, b = dion3.Muon([p], lr=0.1), dion3.Muon([q], lr=0.1)
    g = torch.randn(16, 8, device=device)
    p.grad = g.clone()
    a.step()
    sd = a.state_dict()
    sd["state"][0] = dict(sd["state"][0], momentum=sd["state"][0]["momentum"].t().contiguous().t())
    with torch.no_grad():
        q.copy_(p)
    b.load_state_dict(sd)
    for x, opt in ((p, a), (q, b)):
        x.grad = g * 2
        opt.step()
    assert torch.equal(p, q) and torch.equal(a.state[p]["momentum"], b.state[q]["momentum"])


def test_the_count_of_skipped_steps_resumes():
    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = dion3.Dion3([p], on_nonfinite="skip")
    for t in range(4):
        p.grad = torch.full((8, 8), float("nan")) if t % 2 else torch.randn(8, 8)
        opt.step()
    assert opt.steps_skipped == 2
    sd = copy.deepcopy(opt.state_dict())
    resumed = dion3.Dion3([torch.nn.Parameter(torch.randn(8, 8))], on_nonfinite="skip")
    resumed.load_state_dict(sd)
    assert resumed.steps_skipped == 2
    for bad in (-1, 2**62 + 1, 2**70):  # 2**62 at most: the engine's counter goes on from it
        sd["steps_skipped"] = bad
        with pytest.raises(ValueError, match=rf"'steps_skipped' must be a count in \[0, 2\*\*62\]; got {bad}"):
            resumed.load_state_dict(sd)
        assert resumed.steps_skipped == 2
    sd["steps_skipped"] = 2**62
    resumed.load_state_dict(sd)
    resumed.param_groups[0]["params"][0].grad = torch.full((8, 8), float("nan"))
    resumed.step()
    assert resumed.steps_skipped == 2**62 + 1


def test_step_counts_up_to_two_to_the_62_load_and_go_on():
    # The bound load_state_dict keeps (counts above it are refused, test_errors.py).
    w, b = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(8))
    opt = dion3.Dion3([dict(params=[w]), dict(params=[b], algorithm="adamw")])
    sd = opt.state_dict()
    for st in sd["state"].values():
        st["step"] = 2**62
    opt.load_state_dict(sd)
    w.grad, b.grad = torch.randn(8, 8), torch.randn(8)
    opt.step()
    assert [opt.state[p]["step"] for p in (w, b)] == [2**62 + 1] * 2
    assert torch.isfinite(w).all() and torch.isfinite(b).all()


def test_a_checkpoint_of_other_groups_is_refused_with_the_parameter_named():
    # A matrix group's checkpoint loaded where that position holds a 1-D AdamW parameter: the
    # check that names the parameter answers, not the shape conversion of older checkpoints.
    torch.manual_seed(0)
    w, b = torch.nn.Parameter(torch.randn(16, 8)), torch.nn.Parameter(torch.randn(16))
    saved = dion3.Dion3([dict(params=[w])])
    w.grad = torch.randn_like(w)
    saved.step()
    other = dion3.Dion3([dict(params=[b], algorithm="adamw")])
    with pytest.raises(ValueError, match="group0.param0"):
        other.load_state_dict(saved.state_dict())


def test_state_cleared_by_the_caller_comes_back_for_parameters_without_gradients():
    # opt.state.clear() (a reset), then a step where one parameter has no gradient: state_dict()
    # still covers it (fresh zero state), so the checkpoint loads.
    torch.manual_seed(1)
    a, c = torch.nn.Parameter(torch.randn(8, 6)), torch.nn.Parameter(torch.randn(8, 6))
    opt = dion3.Dion3([a, c])
    a.grad, c.grad = torch.randn_like(a), torch.randn_like(c)
    opt.step()
    opt.state.clear()
    a.grad, c.grad = torch.randn_like(a), None
    opt.step()
    sd = opt.state_dict()
    assert torch.count_nonzero(sd["state"][1]["momentum"]) == 0 and sd["state"][1]["step"] == 0
    a2, c2 = torch.nn.Parameter(a.detach().clone()), torch.nn.Parameter(c.detach().clone())
    fresh = dion3.Dion3([a2, c2])
    fresh.load_state_dict(sd)
    assert torch.equal(fresh.state[a2]["momentum"], opt.state[a]["momentum"])
    # Cleared, then a step where no parameter has a gradient, or straight to state_dict().
    for then_step in (True, False):
        opt.state.clear()
        if then_step:
            a.grad = c.grad = None
            opt.step()
        sd = opt.state_dict()
        assert sorted(sd["state"]) == [0, 1] and sd["state"][0]["step"] == 0
        dion3.Dion3([a2, c2]).load_state_dict(sd)


def test_torch_dcp_state_dict_keeps_the_skipped_count_and_a_frozen_parameter_loads():
    # torch.distributed.checkpoint's state_dict keeps only state and param_groups, and keeps no
    # state for a parameter that does not require gradients: the skipped-step count travels in
    # the groups, the frozen parameter starts afresh, and the run resumes exactly.
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 24, bias=False), torch.nn.Linear(24, 8, bias=False))
        model[1].weight.requires_grad_(False)
        return model, dion3.Dion3(list(model.parameters()), lr=0.02, on_nonfinite="skip")

    def step(model, opt, t, bad=False):
        torch.manual_seed(100 + t)
        model(torch.randn(4, 16)).square().sum().backward()
        if bad:
            model[0].weight.grad[0, 0] = float("inf")
        opt.step()
        opt.zero_grad()

    model, opt = make()
    step(model, opt, 0)
    step(model, opt, 1, bad=True)
    assert opt.steps_skipped == 1
    msd, osd = get_state_dict(model, opt)
    model2, opt2 = make()
    set_state_dict(model2, opt2, model_state_dict=msd, optim_state_dict=osd)
    assert opt2.steps_skipped == 1
    assert "steps_skipped" not in opt2.param_groups[0]
    for t in range(2, 4):
        step(model, opt, t)
        step(model2, opt2, t)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


@pytest.mark.parametrize("flatten", [False, True])
def test_a_checkpoint_saved_while_a_parameter_was_frozen_loads_where_it_trains(flatten):
    # torch.distributed.checkpoint keeps no state for a frozen parameter; loading where it trains,
    # its flattened form hands the optimizer placeholders ({}) for the state it did not find: the
    # parameter starts afresh, the others resume.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    def make(frozen):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 24, bias=False), torch.nn.Linear(24, 8, bias=False))
        model[1].weight.requires_grad_(not frozen)
        return model, dion3.Dion3(list(model.parameters()), lr=0.02)

    model, opt = make(frozen=True)
    for t in range(2):
        torch.manual_seed(100 + t)
        model(torch.randn(4, 16)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    options = StateDictOptions(flatten_optimizer_state_dict=flatten, strict=False)
    msd, osd = get_state_dict(model, opt, options=options)
    model2, opt2 = make(frozen=False)
    set_state_dict(model2, opt2, model_state_dict=msd, optim_state_dict=osd, options=options)
    assert opt2.state[model2[0].weight]["step"] == 2
    assert torch.equal(opt2.state[model2[0].weight]["momentum"], opt.state[model[0].weight]["momentum"])
    assert opt2.state[model2[1].weight]["step"] == 0 and not opt2.state[model2[1].weight]["momentum"].any()


@pytest.mark.parametrize("flatten", [False, True])
def test_a_distributed_checkpoint_whose_groups_held_the_weights_otherwise_is_refused(flatten):
    # torch.distributed.checkpoint matches state by name, but a group whose weights come from
    # several saved groups gets its first weight's saved settings and names (flattened), or none
    # (dion3 then took the defaults: a silent change of lr). Named groups show it: refused.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    def make(order):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8, bias=False) for _ in range(4)])
        named = dict(model.named_parameters())
        return model, dion3.Dion3([dict(params=[named[k] for k in ks], param_names=ks, lr=lr)
                                   for ks, lr in zip(order, (0.02, 0.005))])
    saved = [["0.weight", "1.weight"], ["2.weight", "3.weight"]]
    model, opt = make(saved)
    model(torch.randn(4, 8)).square().sum().backward()
    opt.step()
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    msd, osd = get_state_dict(model, opt, options=options)
    model2, opt2 = make([["0.weight", "3.weight"], ["2.weight", "1.weight"]])
    with pytest.raises(ValueError, match=r"hold these parameters otherwise.*'3.weight' \(group 1 there, 0 here\)"):
        set_state_dict(model2, opt2, model_state_dict=msd, optim_state_dict=osd, options=options)
    assert [g["lr"] for g in opt2.param_groups] == [0.02, 0.005]
    assert all(not opt2.state[p]["momentum"].any() for p in model2.parameters())
    model3, opt3 = make(saved)  # the groups as saved: loads
    set_state_dict(model3, opt3, model_state_dict=msd, optim_state_dict=osd, options=options)
    assert torch.equal(opt3.state[model3[3].weight]["momentum"], opt.state[model[3].weight]["momentum"])


def test_reading_a_frozen_parameters_state_leaves_no_entry_to_refuse():
    # opt.state is a defaultdict: opt.state[p] of a parameter without state inserts {}. It is
    # saved as no state, and an empty entry given by another writer loads as none.
    a, b = torch.nn.Parameter(torch.randn(8, 6)), torch.nn.Parameter(torch.randn(8, 6), requires_grad=False)
    opt = dion3.Dion3([a, b], lr=0.02)
    assert opt.state[b].get("step") is None
    a.grad = torch.randn(8, 6)
    opt.step()
    sd = opt.state_dict()
    assert sorted(sd["state"]) == [0]
    sd["state"][1] = {}
    dion3.Dion3([a, b], lr=0.02).load_state_dict(sd)
    b.requires_grad_(True)
    fresh = dion3.Dion3([a, b], lr=0.02)
    fresh.load_state_dict(sd)
    assert fresh.state[b]["step"] == 0


def test_a_checkpoint_of_another_class_is_named_as_such_or_taken_with_its_algorithm():
    # Dion2 and Dion3 name the error-feedback decay differently: refused, naming the likely cause.
    with pytest.raises(ValueError, match=r"unknown setting 'mu'.*saved by another optimizer class than dion3\.Dion2\?"):
        dion3.Dion2([torch.nn.Parameter(torch.randn(8, 6))]).load_state_dict(
            dion3.Dion3([torch.nn.Parameter(torch.randn(8, 6))]).state_dict())
    # A group's algorithm comes from the checkpoint, as its lr does; set afterwards, it warm-starts
    # Dion3 from Muon's momentum.
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 6))
    muon = dion3.Muon([w], lr=0.02)
    w.grad = torch.randn(8, 6)
    muon.step()
    v = torch.nn.Parameter(w.detach().clone())
    opt = dion3.Dion3([v], lr=0.02)
    opt.load_state_dict(muon.state_dict())
    assert opt.param_groups[0]["algorithm"] == "muon"
    opt.param_groups[0]["algorithm"] = "dion3"
    v.grad = torch.randn(8, 6)
    opt.step()
    assert opt.plan()[0]["algorithm"] == "dion3" and "variance_neuron" in opt.state[v]
