# test_training.py — dion3 as a torch optimizer in use: a tiny model learns, state_dict round trips
# continue exactly, lr schedules compose, grads that are None are skipped, many optimizers coexist.
import io

import pytest
import torch
from torch import nn

import dion3

OPTIMIZERS = [dion3.Dion3, dion3.NorMuon, dion3.Muon]


class TinyLM(nn.Module):
    def __init__(self, vocab=32, d=24):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        h = self.embed(idx)
        h = h + self.down(torch.relu(self.up(h)))
        return self.lm_head(self.norm(h))


def batch(device, seed=0, vocab=32, n=64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (n,), generator=g)
    return x.to(device), ((x * 7 + 3) % vocab).to(device)  # a fixed permutation to learn


def train(model, opt, device, steps, seed=0, scheduler=None):
    losses = []
    x, y = batch(device, seed)
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def make(cls, device, seed=0, **kw):
    torch.manual_seed(seed)
    model = TinyLM().to(device)
    groups = dion3.param_groups(model, elementwise_options=dict(lr=1e-2))
    return model, cls(groups, lr=0.05, **kw)


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_tiny_model_loss_decreases(device, cls):
    model, opt = make(cls, device)
    losses = train(model, opt, device, 40)
    assert losses[-1] < 0.5 * losses[0], losses


def test_param_groups_roles():
    model = TinyLM()
    groups = dion3.param_groups(model, lr=0.01)
    roles = {g["role"]: g["param_names"] for g in groups}
    assert roles["matrix"] == ["up.weight", "down.weight"]
    assert roles["embedding"] == ["embed.weight"] and roles["lm_head"] == ["lm_head.weight"]
    assert set(roles["vector"]) == {"up.bias", "down.bias", "norm.weight", "norm.bias"}
    assert all(g.get("algorithm") == "adamw" for g in groups if g["role"] != "matrix")
    # explicit selectors and overrides
    groups = dion3.param_groups(model, lm_head=model.lm_head, embeddings="embed", lr=0.01,
                                overrides={"down.weight": {"algorithm": "muon", "lr": 0.1}}, elementwise="lion")
    by_name = {n: g for g in groups for n in g["param_names"]}
    assert by_name["down.weight"]["algorithm"] == "muon" and by_name["down.weight"]["lr"] == 0.1
    assert by_name["up.weight"].get("algorithm") is None
    assert by_name["norm.bias"]["algorithm"] == "lion"
    with pytest.raises(ValueError, match="matches no parameter"):
        dion3.param_groups(model, overrides={"nope.weight": {"lr": 1.0}})
    opt = dion3.Dion3(groups)
    assert len(opt.param_groups) == len(groups)


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_state_dict_round_trip_continues_exactly(device, cls):
    model_a, opt_a = make(cls, device)
    train(model_a, opt_a, device, 5)
    buf = io.BytesIO()
    torch.save({"model": model_a.state_dict(), "opt": opt_a.state_dict()}, buf)
    after_a = train(model_a, opt_a, device, 5, seed=1)

    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    model_b, opt_b = make(cls, device, seed=123)  # different init, overwritten by the load
    model_b.load_state_dict(saved["model"])
    opt_b.load_state_dict(saved["opt"])
    after_b = train(model_b, opt_b, device, 5, seed=1)
    assert after_a == after_b
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(pa, pb)
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert sa.keys() == sb.keys() and sa["step"] == sb["step"] == 10
        for k in sa:
            if torch.is_tensor(sa[k]):
                assert torch.equal(sa[k], sb[k]), k


def test_state_dict_keeps_fp32_state_of_bf16_params(device):
    p = nn.Parameter(torch.randn(16, 8, device=device, dtype=torch.bfloat16))
    opt = dion3.Dion3([p], momentum_dtype=torch.float32)
    p.grad = torch.randn_like(p)
    opt.step()
    sd = opt.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    q = nn.Parameter(p.detach().clone())
    opt2 = dion3.Dion3([q], momentum_dtype=torch.float32)
    opt2.load_state_dict(torch.load(buf, weights_only=False))
    st = opt2.state[q]
    assert st["momentum"].dtype == torch.float32 and st["variance_neuron"].dtype == torch.float32
    assert torch.equal(st["momentum"], opt.state[p]["momentum"])
    g = torch.randn_like(p)
    p.grad, q.grad = g, g.clone()
    opt.step()
    opt2.step()
    assert torch.equal(p, q)


def test_lr_scheduler_and_group_lr_untouched(device):
    model, opt = make(dion3.Dion3, device)
    base = [g["lr"] for g in opt.param_groups]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.5 ** t)
    x, y = batch(device)
    for t in range(3):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        before = [g["lr"] for g in opt.param_groups]
        opt.step()
        assert [g["lr"] for g in opt.param_groups] == before  # step reads lr, never writes it
        assert all(type(g["lr"]) is float for g in opt.param_groups)
        sched.step()
        assert [g["lr"] for g in opt.param_groups] == pytest.approx([b * 0.5 ** (t + 1) for b in base])


def test_lr_is_read_every_step(device):
    # A hand-written schedule (g["lr"] = base * scale) takes effect at the next step; lr = 0 freezes.
    p = nn.Parameter(torch.randn(8, 8, device=device))
    opt = dion3.Dion3([p], lr=0.1)
    opt.param_groups[0]["lr"] = 0.0
    w = p.detach().clone()
    p.grad = torch.randn_like(p)
    opt.step()
    assert torch.equal(p, w)
    opt.param_groups[0]["lr"] = 0.1 * 0.5
    p.grad = torch.randn_like(p)
    opt.step()
    assert not torch.equal(p, w)
    assert opt.param_groups[0]["lr"] == 0.05


def test_none_grads_are_skipped(device):
    a = nn.Parameter(torch.randn(8, 4, device=device))
    b = nn.Parameter(torch.randn(4, 8, device=device))
    opt = dion3.Dion3([a, b])
    a.grad = torch.randn_like(a)
    wb = b.detach().clone()
    opt.step()
    assert torch.equal(b, wb) and opt.state[a]["step"] == 1
    # State exists from construction: b's is there, untouched (zeros, no step).
    assert opt.state[b]["step"] == 0 and not opt.state[b]["momentum"].any()
    b.grad = torch.randn_like(b)
    opt.step()  # the set of parameters with gradients changed: the engine is rebuilt
    assert opt.state[a]["step"] == 2 and opt.state[b]["step"] == 1
    opt.zero_grad()
    opt.step()  # nothing to do
    assert opt.state[a]["step"] == 2


def test_steps_counters_survive_rebuild_for_adamw(device):
    # AdamW bias correction depends on the per-parameter step: a rebuild (new grad set) keeps it.
    pa = [nn.Parameter(torch.randn(5, device=device)), nn.Parameter(torch.randn(3, device=device))]
    pb = [nn.Parameter(p.detach().clone()) for p in pa]
    ours = dion3.Dion3([dict(params=pa, algorithm="adamw")])
    theirs = torch.optim.AdamW(pb, lr=0.01, betas=(0.9, 0.95), weight_decay=0.01)
    g = torch.Generator().manual_seed(0)
    for t in range(6):
        for i, (x, y) in enumerate(zip(pa, pb)):
            if t == 3 and i == 1:
                x.grad = y.grad = None  # skipped by both
            else:
                gr = torch.randn(x.shape, generator=g).to(device)
                x.grad, y.grad = gr, gr.clone()
        ours.step()
        theirs.step()
    for x, y in zip(pa, pb):
        assert torch.allclose(x, y, atol=1e-6)


def test_add_param_group_later(device):
    a = nn.Parameter(torch.randn(8, 4, device=device))
    opt = dion3.Muon([a])
    a.grad = torch.randn_like(a)
    opt.step()
    v = nn.Parameter(torch.randn(4, device=device))
    opt.add_param_group(dict(params=[v], algorithm="lion", lr=1e-3))
    v.grad = torch.ones_like(v)
    w = v.detach().clone()
    opt.step()
    assert torch.allclose(v, w * (1 - 1e-3 * 0.01) - 1e-3)


def test_weight_reallocated_is_followed(device):
    p = nn.Parameter(torch.randn(8, 8, device=device))
    opt = dion3.Muon([p], lr=0.1)
    p.grad = torch.randn_like(p)
    opt.step()
    p.data = p.data.clone()  # new storage
    w = p.detach().clone()
    opt.step()
    assert not torch.equal(p, w)


def test_weight_moved_within_its_storage_is_followed(device):
    # p.data = another view of the same storage (another offset): the engine follows the new
    # place, not the old one, which is left alone.
    torch.manual_seed(0)
    flat = torch.randn(256, device=device)
    p = nn.Parameter(flat[:128].view(16, 8))
    q = nn.Parameter(flat[:128].view(16, 8).clone())
    opts = [dion3.Muon([x], lr=0.1) for x in (p, q)]
    g = torch.randn(16, 8, device=device)
    for x, opt in zip((p, q), opts):
        x.grad = g.clone()
        opt.step()
    with torch.no_grad():
        flat[128:] = flat[:128]
    p.data = flat[128:].view(16, 8)
    old = flat[:128].clone()
    for x, opt in zip((p, q), opts):
        x.grad = g.clone()
        opt.step()
    assert torch.equal(p, q) and torch.equal(flat[:128], old)


def test_storage_left_behind_is_released_at_once(device):
    # The engine keeps nothing of a storage a weight or state tensor left (model.to() and
    # offloading move parameters with .data = ...): only the caller's reference remains.
    p = nn.Parameter(torch.randn(16, 8, device=device))
    opt = dion3.Dion3([p])
    p.grad = torch.randn_like(p)
    opt.step()
    for t in (p, opt.state[p]["momentum"]):
        old = t.untyped_storage()
        t.data = t.data.clone()
        assert torch._C._storage_Use_Count(old._cdata) == 1


@pytest.mark.parametrize("how", ["data", "set_"])
def test_a_gradient_given_new_storage_in_place_is_followed(device, how):
    # The same .grad tensor with other storage (p.grad.data = ..., set_): the step reads the new
    # values, as it does for a new .grad tensor, not the freed old storage.
    ps = [nn.Parameter(torch.ones(64, 32, device=device)) for _ in range(2)]
    opts = [dion3.Muon([p], lr=0.1) for p in ps]
    for p, opt in zip(ps, opts):
        p.grad = torch.ones_like(p)
        opt.step()
    ps[1].grad = torch.full_like(ps[0], 5.0)
    new = ps[1].grad.clone()
    if how == "data":
        ps[0].grad.data = new
    else:
        ps[0].grad.set_(new)
    filler = torch.ones(64, 32, device=device)  # may take the old gradient's freed place
    for opt in opts:
        opt.step()
    del filler
    assert torch.equal(ps[0], ps[1])
    assert torch.equal(opts[0].state[ps[0]]["momentum"], opts[1].state[ps[1]]["momentum"])


@pytest.mark.parametrize("how", ["item", "list", "tuple"])
def test_a_parameter_replaced_in_its_group_is_stepped_instead_of_the_old_one(device, how):
    # param_groups[i]["params"][j] = new (or a new list or tuple of the same length): as in torch's own
    # optimizers, the new parameter is stepped from fresh state and the old one is left alone.
    torch.manual_seed(0)
    old, new = nn.Parameter(torch.randn(16, 8, device=device)), nn.Parameter(torch.randn(16, 8, device=device))
    fresh = nn.Parameter(new.detach().clone())
    opt, ref = dion3.Muon([old], lr=0.1), dion3.Muon([fresh], lr=0.1)
    old.grad = torch.randn_like(old)
    opt.step()
    if how == "item":
        opt.param_groups[0]["params"][0] = new
    elif how == "list":
        opt.param_groups[0]["params"] = [new]
    else:
        opt.param_groups[0]["params"] = (new,)
    new.grad = torch.randn_like(new)
    fresh.grad = new.grad.clone()
    before = old.detach().clone()
    opt.step()
    ref.step()
    assert torch.equal(old, before) and torch.equal(new, fresh)


def test_state_reallocated_is_followed(device):
    # state[p][k].data = other (new storage under the same tensor) steps as state[p][k] = other does:
    # the engine follows the new storage instead of updating the old one, which nobody reads.
    torch.manual_seed(0)
    w0, b0 = torch.randn(16, 8, device=device), torch.randn(8, device=device)
    grads = [(torch.randn_like(w0), torch.randn_like(b0)) for _ in range(3)]
    results = []
    for how in ("data", "assign"):
        w, b = nn.Parameter(w0.clone()), nn.Parameter(b0.clone())
        opt = dion3.Dion3([dict(params=[w]), dict(params=[b], algorithm="adamw")], lr=0.05, fraction=0.5)
        for i, (gw, gb) in enumerate(grads):
            w.grad, b.grad = gw.clone(), gb.clone()
            opt.step()
            if i == 0:
                for p in (w, b):
                    for k, t in opt.state[p].items():
                        if isinstance(t, torch.Tensor) and k != "step":
                            new = t * 0.5 + 0.25
                            if how == "data":
                                t.data = new
                            else:
                                opt.state[p][k] = new
        results.append([w.detach().clone(), b.detach().clone()] +
                       [t.clone() for p in (w, b) for k, t in sorted(opt.state[p].items()) if isinstance(t, torch.Tensor)])
    assert len(results[0]) == 6  # two weights; momentum and variance_neuron, momentum and variance
    for x, y in zip(*results):
        assert torch.equal(x, y)


def test_twenty_optimizers_over_different_shape_sets(device):
    opts = []
    for i in range(20):
        g = torch.Generator().manual_seed(i)
        shapes = [(4 + i, 3 + 2 * i), (3 + i % 5, 17), (2 * i + 1, 5, 3)]
        ps = [nn.Parameter(torch.randn(s, generator=g).to(device)) for s in shapes]
        cls = OPTIMIZERS[i % 3]
        opt = cls(ps, lr=0.01)
        opts.append((opt, ps))
    for _ in range(2):
        for opt, ps in opts:
            for p in ps:
                p.grad = torch.randn_like(p)
            opt.step()
    for opt, ps in opts:
        assert all(torch.isfinite(p).all() for p in ps)
        assert all(opt.state[p]["step"] == 2 for p in ps)


def test_closure_is_called(device):
    p = nn.Parameter(torch.randn(6, 6, device=device))
    opt = dion3.Dion3([p])

    def closure():
        opt.zero_grad()
        loss = (p ** 2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss is not None and opt.state[p]["step"] == 1


def test_plan_reports_megabatches(device):
    ps = [nn.Parameter(torch.randn(16, 8, device=device)) for _ in range(3)]
    opt = dion3.Dion3(ps, fraction=0.25)
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    (mb,) = opt.plan()
    assert mb["count"] == 3 and mb["rows"] == 16 and mb["cols"] == 8 and mb["selected_rows"] == 4


def test_deepcopy_and_pickle(device):
    import copy
    import pickle
    p = nn.Parameter(torch.randn(8, 6, device=device))
    opt = dion3.Dion3([p], on_nonfinite="skip")
    p.grad = torch.randn_like(p)
    opt.step()
    clone = copy.deepcopy(opt)
    (q,) = clone.param_groups[0]["params"]
    assert q is not p and torch.equal(q, p) and clone._on_nonfinite == "skip"
    q.grad = p.grad.clone()
    opt.step()
    clone.step()
    assert torch.equal(p, q) and clone.state[q]["step"] == 2
    again = pickle.loads(pickle.dumps(opt))
    assert again.state_dict()["state"][0]["step"] == 2


def test_load_state_dict_missing_group_keys_take_defaults(device):
    p = nn.Parameter(torch.randn(8, 6, device=device))
    opt = dion3.Dion3([p])
    p.grad = torch.randn_like(p)
    opt.step()
    sd = opt.state_dict()
    for g in sd["param_groups"]:
        del g["orthogonalizer"], g["scale_lr_by_fraction"]
    opt2 = dion3.Dion3([p], orthogonalizer="gram")
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["orthogonalizer"] == "gram"
    opt2.step()
    assert opt2.state[p]["step"] == 2


def test_state_exists_from_construction_and_for_groups_added_later(device):
    a = nn.Parameter(torch.randn(8, 4, device=device))
    b = nn.Parameter(torch.randn(6, device=device))
    opt = dion3.Dion3([a])
    assert opt.state[a]["step"] == 0 and opt.state[a]["momentum"].shape == a.shape
    opt.add_param_group(dict(params=[b], algorithm="adamw"))
    assert set(opt.state[b]) == {"momentum", "variance", "step"} and opt.state[b]["step"] == 0
    assert len(opt.state_dict()["state"]) == 2  # the same keys whatever got a gradient


def test_unpickled_optimizer_of_an_older_version_takes_new_keys_from_defaults(device):
    # A pickle made before a key existed: its groups and defaults lack it; step() must still work.
    import pickle
    p = nn.Parameter(torch.randn(8, 6, device=device))
    opt = dion3.Dion3([p], nesterov=False)
    p.grad = torch.randn_like(p)
    opt.step()
    state = opt.__getstate__()
    for d in [state["defaults"], *state["param_groups"]]:
        del d["nesterov"], d["orthogonalizer"]
    old = dion3.Dion3.__new__(dion3.Dion3)
    old.__setstate__(state)
    again = pickle.loads(pickle.dumps(old))
    assert again.param_groups[0]["nesterov"] is False and again.param_groups[0]["orthogonalizer"] == "auto"
    (q,) = again.param_groups[0]["params"]
    q.grad = torch.randn_like(q)
    again.step()
    assert again.state[q]["step"] == 2


class _Tagged(dion3.Dion3):
    """A user's subclass whose constructor needs more than a parameter list."""

    def __init__(self, params, tag, **kw):
        super().__init__(params, **kw)
        self.tag = tag


def test_unpickling_a_subclass_and_loading_under_float64_defaults(device):
    import copy
    p = nn.Parameter(torch.randn(8, 6, device=device))
    opt = _Tagged([p], "mine", lr=0.02)
    p.grad = torch.randn_like(p)
    opt.step()
    clone = copy.deepcopy(opt)  # __setstate__ cannot make a fresh _Tagged: falls back to its own defaults
    assert "differentiable" not in clone.param_groups[0] and clone.param_groups[0]["lr"] == 0.02
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        q = nn.Parameter(torch.randn(8, 6, device=device, dtype=torch.float32))
        other = dion3.Dion3([q])
        other.load_state_dict(opt.state_dict())
    finally:
        torch.set_default_dtype(previous)
    assert other.param_groups[0]["lr"] == 0.02


def test_empty_coefficient_list_is_refused_by_name():
    with pytest.raises(ValueError, match="'coefficients' must hold at least one"):
        opt = dion3.Dion3([nn.Parameter(torch.randn(8, 6))], coefficients=[])
        opt.param_groups[0]["params"][0].grad = torch.randn(8, 6)
        opt.step()
