"""dion3.optim.Muon against torch.optim.Muon: the same constructor and group keys, the update of a
float64 transcription of torch's algorithm (averaged momentum, Nesterov, sqrt(max(1, m/n))),
checkpoints that load both ways, and dion3's refusals where a key or a checkpoint would be misread."""
import inspect
import math
import warnings

import pytest
import torch

import dion3
from reference import orth_standard

torch_muon = getattr(torch.optim, "Muon", None)
needs_torch_muon = pytest.mark.skipif(torch_muon is None, reason="this PyTorch has no torch.optim.Muon")

TORCH_NS = [(3.4445, -4.775, 2.0315)] * 5


def torch_muon_f64(W, B, G, lr, wd, mu, nesterov, coeffs, adjust_lr_fn, eps=1e-7):
    """One step of torch.optim.Muon (its _single_tensor_muon) in float64."""
    B.mul_(mu).add_((1 - mu) * G)
    U = (1 - mu) * G + mu * B if nesterov else B
    O = orth_standard(U, coeffs, eps=eps, floor=True)  # torch divides by max(norm, eps)
    m, n = W.shape
    ratio = {None: math.sqrt(max(1, m / n)), "original": math.sqrt(max(1, m / n)),
             "match_rms_adamw": 0.2 * math.sqrt(max(m, n)), "spectral_unclamped": math.sqrt(m / n)}[adjust_lr_fn]
    W.mul_(1 - lr * wd).sub_(lr * ratio * O)


@pytest.mark.parametrize("nesterov,adjust_lr_fn,shape", [(True, None, (48, 24)), (False, "match_rms_adamw", (24, 48)),
                                                          (True, "spectral_unclamped", (32, 32)),
                                                          (True, "original", (20, 40))])
def test_steps_as_torch_muon_does_in_float64(nesterov, adjust_lr_fn, shape):
    torch.manual_seed(1)
    w = torch.nn.Parameter(torch.randn(*shape))
    W, B = w.detach().double().clone(), torch.zeros(shape, dtype=torch.float64)
    opt = dion3.optim.Muon([w], lr=0.02, weight_decay=0.05, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn,
                           orthogonalizer="standard")
    W0 = W.clone()
    for mu in (0.85, 0.9, 0.93, 0.95, 0.95):  # a momentum warm-up, set in the group between steps
        opt.param_groups[0]["momentum"] = mu
        w.grad = torch.randn(shape)
        torch_muon_f64(W, B, w.grad.double(), 0.02, 0.05, mu, nesterov, TORCH_NS, adjust_lr_fn)
        opt.step()
    moved = (W - W0).abs().max().item()
    assert (w.detach().double() - W).abs().max().item() <= 2e-4 * moved
    buf = opt.state_dict()["state"][0]["momentum_buffer"]
    assert torch.allclose(buf.double(), B, rtol=1e-5, atol=1e-6)


@needs_torch_muon
def test_same_signature_defaults_and_group_keys_as_torch():
    ours = inspect.signature(dion3.optim.Muon).parameters
    theirs = inspect.signature(torch_muon).parameters
    positional = [n for n, p in ours.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == list(theirs)  # same names, same order
    for name, p in theirs.items():
        if name != "params":
            assert ours[name].default == p.default, name
    w = torch.nn.Parameter(torch.randn(8, 4))
    ours_keys = set(dion3.optim.Muon([w]).param_groups[0])
    assert set(torch_muon([w]).param_groups[0]) <= ours_keys


@needs_torch_muon
def test_close_to_torch_optim_muon_itself():
    # torch runs Newton-Schulz in bfloat16: the updates agree to its rounding, not to float32's
    # (the float64 test above is the tight one).
    def run(make):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(32, 64, bias=False), torch.nn.Linear(64, 16, bias=False))
        w0 = [p.detach().clone() for p in net.parameters()]
        opt = make(net.parameters())
        x = torch.randn(16, 32)
        for _ in range(4):
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
        return [p.detach() - a for p, a in zip(net.parameters(), w0)]

    theirs = run(lambda ps: torch_muon(ps, lr=0.02))
    ours = run(lambda ps: dion3.optim.Muon(ps, lr=0.02))
    for a, b in zip(theirs, ours):
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99
        assert abs(a.norm() / b.norm() - 1) < 0.03


@needs_torch_muon
def test_checkpoints_load_both_ways():
    torch.manual_seed(2)
    shapes = [(24, 16), (16, 40)]
    params = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
    theirs = torch_muon(params, lr=0.01, momentum=0.9)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        theirs.step()
    ours = dion3.optim.Muon(params, lr=0.01)
    ours.load_state_dict(theirs.state_dict())
    assert ours.param_groups[0]["momentum"] == 0.9  # the saved group's settings, as torch loads them
    saved = ours.state_dict()
    assert set(saved["state"][0]) >= {"momentum_buffer"}
    for i, p in enumerate(params):
        assert torch.equal(saved["state"][i]["momentum_buffer"], theirs.state[p]["momentum_buffer"])
    # One more step from the same buffers: torch's momentum and ours move alike.
    for p in params:
        p.grad = torch.randn_like(p)
    want = [0.9 * theirs.state[p]["momentum_buffer"] + 0.1 * p.grad for p in params]
    ours.step()
    for i in range(len(params)):
        assert torch.allclose(ours.state_dict()["state"][i]["momentum_buffer"], want[i], rtol=1e-6, atol=1e-7)
    back = torch_muon(params, lr=0.01)
    back.load_state_dict(ours.state_dict())
    for i, p in enumerate(params):
        assert torch.equal(back.state[p]["momentum_buffer"], ours.state_dict()["state"][i]["momentum_buffer"])
    back.step()  # torch steps from our checkpoint


def test_refuses_the_summed_momentum_of_dion3_muon():
    w = torch.nn.Parameter(torch.randn(8, 8))
    w.grad = torch.randn(8, 8)
    summed = dion3.Muon([w])
    summed.step()
    opt = dion3.optim.Muon([w])
    with pytest.raises(ValueError, match="load it into dion3.Muon"):
        opt.load_state_dict(summed.state_dict())
    assert not opt.state_dict()["state"][0]["momentum_buffer"].any()  # nothing loaded


def test_refuses_what_it_would_misread():
    w = torch.nn.Parameter(torch.randn(8, 8))
    with pytest.raises(TypeError):
        dion3.optim.Muon([w], mu=0.9)  # not torch's argument
    with pytest.raises(ValueError, match="unknown setting 'mu'; dion3 calls it 'momentum'"):
        dion3.optim.Muon([dict(params=[w], mu=0.9)])
    with pytest.raises(ValueError, match="unknown setting 'adjust_lr'; dion3 calls it 'adjust_lr_fn'"):
        dion3.optim.Muon([dict(params=[w], adjust_lr="rms_norm")])  # dion3.Muon's name, though it ends in _lr
    with pytest.raises(ValueError, match="Adjust learning rate function spectral_norm is not supported"):
        dion3.optim.Muon([w], adjust_lr_fn="spectral_norm")  # torch's own check and message
    with pytest.raises(ValueError, match="momentum should be >= 0"):
        dion3.optim.Muon([w], momentum=-0.1)
    opt = dion3.optim.Muon([w])
    w.grad = torch.randn(8, 8)
    for key, value, match in [("momentum", 1.0, "'momentum' must lie in \\[0, 1\\)"),
                              ("ns_steps", 0, "'ns_steps' must lie in \\[1, 16\\]"),
                              ("ns_coefficients", (1.0, 2.0), "three numbers"),
                              ("adjust_lr_fn", "rms_norm", "'adjust_lr_fn' must be None"),
                              ("eps", 0.0, "'eps' must be a float32 number from 1e-18"),
                              ("eps", 1e-30, "'eps' must be a float32 number from"),  # a norm's square underflows
                              ("eps", 1e39, "'eps' must be a float32 number from"),
                              ("momentum", "0.9", "'momentum' must be a number")]:
        good = opt.param_groups[0][key]
        opt.param_groups[0][key] = value
        before = w.detach().clone()
        with pytest.raises(ValueError, match=match):
            opt.step()
        assert torch.equal(w.detach(), before)  # refused before anything moved
        opt.param_groups[0][key] = good
    opt.step()


def test_ns_settings_reach_the_engine():
    # Fewer or other quintic steps change the update: the engine reads ns_steps and
    # ns_coefficients from the group (an ignored key would give torch's default iteration).
    for group, steps in [(dict(ns_steps=2), 2), (dict(ns_coefficients=(2.0, -1.5, 0.5), ns_steps=3), 3)]:
        torch.manual_seed(3)
        w = torch.nn.Parameter(torch.randn(16, 32))
        w0 = w.detach().clone()
        w.grad = torch.randn(16, 32)
        dion3.optim.Muon([w], lr=0.1, weight_decay=0.0, **group).step()
        got = (w0 - w.detach()).double() / 0.1
        G = w.grad.double()
        coeffs = [group.get("ns_coefficients", TORCH_NS[0])] * steps
        want = orth_standard((1 - 0.95) * G + 0.95 * (1 - 0.95) * G, coeffs)  # sqrt(max(1, 16/32)) = 1
        assert (got - want).abs().max() < 1e-4 * want.abs().max()
        default = orth_standard(G, TORCH_NS)
        assert (got - default).abs().max() > 1e-2 * default.abs().max()


def test_lr_scheduler_and_dion3_extras():
    w = torch.nn.Parameter(torch.randn(3, 8, 4))  # a stack of three 8 x 4 matrices
    opt = dion3.optim.Muon([w], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        w.grad = torch.randn_like(w)
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)
    assert torch.isfinite(w).all()
    with pytest.raises(ValueError, match="needs a matrix"):
        dion3.optim.Muon([torch.nn.Parameter(torch.randn(5))])


@needs_torch_muon
def test_benchmark_times_both(capsys):
    import json

    from dion3 import benchmark
    benchmark.main(["--model", "tiny", "--layers", "1", "--device", "cpu", "--optimizers", "torch.Muon,optim.Muon",
                    "--steps", "1", "--warmup", "1"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["optimizer"] for r in rows] == ["torch.optim.Muon", "optim.Muon"]
    assert all(r["step_ms"] > 0 and r["matrices"] == 6 and r["vectors"] == 0 for r in rows)


def test_eps_is_torchs_floor_on_the_norm():
    # Gradients whose momentum's norm lies below eps: torch divides by eps there, so the update
    # shrinks with them; above it, it does not. Any eps float32 holds is followed.
    torch.manual_seed(6)
    shape = (16, 24)
    for eps, scale, later in [(1e-3, 1e-6, 1e-3), (1e-3, 1.0, 1e-3), (1e-9, 1e-8, 1e-9), (1e-7, 1e-6, 1e-3)]:
        w = torch.nn.Parameter(torch.randn(*shape))
        W, B = w.detach().double().clone(), torch.zeros(shape, dtype=torch.float64)
        W0 = W.clone()
        opt = dion3.optim.Muon([w], lr=0.02, eps=eps, orthogonalizer="standard")
        for t in range(3):
            if t == 2:  # changed between steps: followed, as torch reads it at each step
                opt.param_groups[0]["eps"] = eps = later
            w.grad = torch.randn(shape) * scale
            torch_muon_f64(W, B, w.grad.double(), 0.02, 0.1, 0.95, True, TORCH_NS, None, eps=eps)
            opt.step()
        assert (w.detach().double() - W).abs().max().item() <= 2e-4 * (W - W0).abs().max().item(), (eps, scale)


def test_small_gradients_and_torch_scalars_as_torch():
    # The iteration's input is scaled by 1 / max(norm, 1e-7) as torch's is: an update of the same
    # size whatever the gradients' scale (down to the floor); schedules may write NumPy scalars or
    # one-element tensors.
    np = pytest.importorskip("numpy")
    torch.manual_seed(4)
    shape = (24, 40)
    w = torch.nn.Parameter(torch.randn(*shape))
    W, B = w.detach().double().clone(), torch.zeros(shape, dtype=torch.float64)
    opt = dion3.optim.Muon([w], lr=0.02, orthogonalizer="standard")
    W0 = W.clone()
    for mu in (np.float32(0.9), torch.tensor(0.95), np.float64(0.95)):
        opt.param_groups[0]["momentum"] = mu
        w.grad = torch.randn(shape) * 1e-5
        torch_muon_f64(W, B, w.grad.double(), 0.02, 0.1, float(mu), True, TORCH_NS, None)
        opt.step()
    assert (w.detach().double() - W).abs().max().item() <= 2e-4 * (W - W0).abs().max().item()


def test_a_learning_rate_tensor_that_requires_grad_steps_without_a_warning():
    # A learned or scheduled lr may be a tensor that requires grad; reading it is no autograd use.
    w = torch.nn.Parameter(torch.randn(8, 6))
    lr = torch.tensor(0.02, requires_grad=True)
    opt = dion3.optim.Muon([w], lr=lr)
    w.grad = torch.randn(8, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
    assert opt.param_groups[0]["lr"] is lr


def test_state_is_torchs_live_buffer_and_starts_at_the_first_step():
    torch.manual_seed(5)
    used, unused = torch.nn.Parameter(torch.randn(8, 6)), torch.nn.Parameter(torch.randn(6, 4))
    # A checkpoint saved before any step, and one where a parameter never had a gradient: torch
    # keeps no state for those parameters, and they start afresh here as they would there.
    fresh = torch_muon([used, unused]).state_dict() if torch_muon else {"state": {}, "param_groups": [
        dict(lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True, ns_coefficients=(3.4445, -4.775, 2.0315),
             eps=1e-7, ns_steps=5, adjust_lr_fn=None, params=[0, 1])]}
    opt = dion3.optim.Muon([used, unused], lr=0.1)
    opt.load_state_dict(fresh)
    used.grad = torch.randn(8, 6)
    opt.step()
    assert set(opt.state[used]) == {"momentum_buffer", "step"}  # torch's name, live
    saved = opt.state_dict()
    saved["state"].pop(1, None)  # torch saves no state for a parameter that never stepped
    opt.load_state_dict(saved)
    # Replacing the buffer resets the momentum, as it does in torch.
    opt.state[used]["momentum_buffer"] = torch.zeros_like(used)
    g = torch.randn(8, 6)
    used.grad = g.clone()
    opt.step()
    assert torch.allclose(opt.state[used]["momentum_buffer"], 0.05 * g, atol=1e-7)


def test_local_names_repeated_across_groups():
    # torch takes named_parameters() of several modules, whose local names repeat ('weight').
    blocks = [torch.nn.Linear(6, 6, bias=False) for _ in range(2)]
    opt = dion3.optim.Muon([dict(params=list(b.named_parameters())) for b in blocks], lr=0.02)
    for b in blocks:
        b.weight.grad = torch.randn(6, 6)
    opt.step()
    assert all(torch.isfinite(b.weight).all() for b in blocks)


def test_flattened_distributed_checkpoint_round_trip():
    # torch.distributed.checkpoint's flattened form (torchtitan's) keys state by the live names.
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    torch.manual_seed(6)
    model = torch.nn.Sequential(torch.nn.Linear(8, 12, bias=False), torch.nn.Linear(12, 4, bias=False))
    opt = dion3.optim.Muon(model.parameters(), lr=0.02)
    model(torch.randn(3, 8)).square().sum().backward()
    opt.step()
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    saved = get_optimizer_state_dict(model, opt, options=options)
    again = dion3.optim.Muon(model.parameters(), lr=0.02)
    set_optimizer_state_dict(model, again, saved, options=options)
    for p in model.parameters():
        assert torch.equal(again.state[p]["momentum_buffer"], opt.state[p]["momentum_buffer"])


def test_dion3_muon_with_ema_momentum_is_the_same_update():
    # dion3.Muon(ema_momentum=True) with torch's settings spelled dion3's way steps as the drop-in,
    # but for the norm's guard (algorithm.md §2's + 1e-7 against torch's max(norm, 1e-7)).
    torch.manual_seed(7)
    w0 = torch.randn(24, 16)
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    ours = dion3.Muon([a], lr=0.02, mu=0.9, weight_decay=0.1, nesterov=True, ema_momentum=True,
                      adjust_lr="spectral_norm_clamped", coefficients=TORCH_NS, orthogonalizer="standard")
    theirs = dion3.optim.Muon([b], lr=0.02, momentum=0.9, orthogonalizer="standard")
    for _ in range(3):
        g = torch.randn(24, 16)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    assert (a - b).abs().max() <= 2.5e-7  # one rounding of the weights (|w| < 4) at most
    assert torch.equal(ours.state[a]["momentum"], theirs.state[b]["momentum_buffer"])


def test_keys_of_the_other_form_are_refused_both_ways():
    w = torch.nn.Parameter(torch.randn(8, 8))
    with pytest.raises(ValueError, match="dion3 calls it 'coefficients'"):
        dion3.Muon([dict(params=[w], ns_steps=5)])  # torch's key: no longer a silent no-op
    with pytest.raises(ValueError, match="'cautious_wd' is a setting of dion3's own optimizers"):
        dion3.optim.Muon([dict(params=[w], cautious_wd=True)])
    with pytest.raises(ValueError, match="steps torch.optim.Muon's update only"):
        dion3.optim.Muon([dict(params=[w]), dict(params=[torch.nn.Parameter(torch.randn(4))], algorithm="adamw")])
    with pytest.raises(ValueError, match="another optimizer"):
        dion3.optim.Muon([torch.nn.Parameter(torch.randn(4))])


def test_a_summed_checkpoint_stays_summed_in_an_averaging_muon():
    # A reference (or earlier dion3) checkpoint has no ema_momentum: its momentum is a sum, and the
    # group it loads into keeps it one rather than taking the constructor's averaged form.
    w = torch.nn.Parameter(torch.randn(8, 6))
    w.grad = torch.randn(8, 6)
    summed = dion3.Muon([w])
    summed.step()
    sd = summed.state_dict()
    for g in sd["param_groups"]:
        g.pop("ema_momentum")
    averaging = dion3.Muon([w], ema_momentum=True)
    averaging.load_state_dict(sd)
    assert averaging.param_groups[0]["ema_momentum"] is False
