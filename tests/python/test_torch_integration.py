# test_torch_integration.py — dion3 alongside PyTorch machinery: torch.compile'd models (and a
# compiled training step that calls opt.step()), and, on CUDA, the current stream and CUDA-graph
# capture of optimizer.step().
import pytest
import torch
from torch import nn

import dion3


def tiny(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).to(device)


@pytest.mark.parametrize("backend", ["aot_eager"])
def test_compiled_model_trains(device, backend):
    model = tiny(device)
    ref = tiny(device)
    compiled = torch.compile(model, backend=backend)
    opt = dion3.Dion3(dion3.param_groups(model), lr=0.02)
    opt_ref = dion3.Dion3(dion3.param_groups(ref), lr=0.02)
    x, y = torch.randn(32, 8, device=device), torch.randn(32, 4, device=device)
    for _ in range(5):
        for m, o in ((compiled, opt), (ref, opt_ref)):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(a, b, atol=1e-5)


def test_compiled_train_step_with_optimizer_inside(device):
    model = tiny(device)
    opt = dion3.Muon(dion3.param_groups(model), lr=0.02)
    x, y = torch.randn(32, 8, device=device), torch.randn(32, 4, device=device)

    @torch.compile(backend="aot_eager")
    def train_step():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()  # the engine call is opaque to dynamo: a graph break, not an error
        return loss

    losses = [train_step().item() for _ in range(6)]
    assert losses[-1] < losses[0]


@pytest.mark.skipif(not (torch.cuda.is_available() and dion3.cuda_built()), reason="needs CUDA")
def test_runs_on_a_side_stream():
    p = nn.Parameter(torch.randn(64, 32, device="cuda"))
    q = nn.Parameter(p.detach().clone())
    g = torch.randn_like(p)
    a, b = dion3.Dion3([p]), dion3.Dion3([q])
    p.grad, q.grad = g, g.clone()
    a.step()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        b.step()
    torch.cuda.current_stream().wait_stream(s)
    assert torch.equal(p, q)


@pytest.mark.skipif(not (torch.cuda.is_available() and dion3.cuda_built()), reason="needs CUDA")
def test_cuda_graph_capture_of_step():
    # Matrices, and vectors in AdamW and Lion groups (their bias correction reads the step count
    # on the device, so replays stay right; many small ones share a multi-tensor launch).
    shapes = [(64, 32)] * 3 + [(32,)] * 5 + [(7,)] * 3
    ps = [nn.Parameter(torch.randn(*s, device="cuda")) for s in shapes]
    qs = [nn.Parameter(p.detach().clone()) for p in ps]
    grads = [torch.randn_like(p) for p in ps]
    for p, g in zip(ps, grads):
        p.grad = g
    for q, g in zip(qs, grads):
        q.grad = g.clone()
    groups = lambda xs: [dict(params=xs[:3]), dict(params=xs[3:8], algorithm="adamw"),  # noqa: E731
                         dict(params=xs[8:], algorithm="lion", lr=1e-3)]
    opt = dion3.Dion3(groups(ps), on_nonfinite="skip")
    eager = dion3.Dion3(groups(qs), on_nonfinite="skip")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        opt.step()  # warm-up: builds the engine and its workspace outside the capture
    torch.cuda.current_stream().wait_stream(s)
    eager.step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for _ in range(3):
        graph.replay()
        eager.step()
    torch.cuda.synchronize()
    for p, q in zip(ps, qs):
        assert torch.allclose(p, q, atol=1e-6)
    # Replays advance the step counters on the device; state_dict() folds them in.
    assert opt.state_dict()["state"][0]["step"] == 4 == eager.state[qs[0]]["step"]
    assert opt.state_dict()["state"][3]["step"] == 4 == eager.state[qs[3]]["step"]  # an AdamW vector
    assert opt.steps_skipped == 0


@pytest.mark.skipif(not (torch.cuda.is_available() and dion3.cuda_built()), reason="needs CUDA")
def test_workspace_comes_from_torch_caching_allocator():
    ps = [nn.Parameter(torch.randn(256, 128, device="cuda")) for _ in range(4)]
    for p in ps:
        p.grad = torch.randn_like(p)
    opt = dion3.Dion3(ps, fraction=0.5)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    opt.step()
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before
    state = sum(t.numel() * t.element_size() for p in ps for t in opt.state[p].values() if torch.is_tensor(t))
    workspace = sum(mb["workspace_bytes"] for mb in opt.plan())
    assert workspace > 0 and grown >= state + workspace


def test_async_step_counters_fold_into_state(device):
    # What a CUDA-graph replay does, driven by hand so it runs on CPU too: the engine's
    # capture-safe step advances only the device counters; state_dict() folds them in.
    ps = [nn.Parameter(torch.randn(16, 8, device=device)), nn.Parameter(torch.randn(8, device=device))]
    qs = [nn.Parameter(p.detach().clone()) for p in ps]
    groups = lambda xs: [dict(params=xs[:1]), dict(params=xs[1:], algorithm="adamw")]  # noqa: E731
    opt, eager = dion3.Dion3(groups(ps)), dion3.Dion3(groups(qs))
    for xs in (ps, qs):
        for x in xs:
            x.grad = torch.ones_like(x)
    opt.step()
    eager.step()
    for _ in range(2):
        opt._engine.step_async()  # as a replay would
        opt._counters_pending = True
        eager.step()
    assert all(torch.allclose(p, q, atol=1e-6) for p, q in zip(ps, qs))
    sd = opt.state_dict()
    assert [sd["state"][i]["step"] for i in (0, 1)] == [3, 3]
    ps[0].grad[0, 0] = float("nan")
    opt._engine.step_async()  # dropped on the device
    opt._counters_pending = True
    assert opt.steps_skipped == 1 and opt.state[ps[0]]["step"] == 3
