# test_torch_integration.py — dion3 alongside PyTorch machinery: torch.compile'd models (and a
# compiled training step that calls opt.step()), PyTorch's CPU threads, and, on CUDA, the current
# stream and CUDA-graph capture of optimizer.step().
import copy
import ctypes
import json
import os
import re
import subprocess
import sys
import threading
import warnings

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


@pytest.mark.parametrize("algorithm", ["dion3", "muon", "adamw"])
def test_channels_last_weights_step_as_their_contiguous_twins(device, algorithm):
    # A CNN converted to channels_last: its convolution weights are stepped in memory order (a
    # flattened matrix's columns permuted, which orthogonalization, row selection and per-row
    # normalization follow), their state kept in the same layout. Equal to the contiguous model
    # up to the order of floating-point sums (exactly, element-wise); a checkpoint moves between
    # the two; converting the model back after steps goes on stepping.
    torch.manual_seed(0)
    a = nn.Sequential(nn.Conv2d(4, 8, 3), nn.Conv3d(8, 6, (1, 2, 2))).to(device)
    b = nn.Sequential(nn.Conv2d(4, 8, 3), nn.Conv3d(8, 6, (1, 2, 2))).to(device)
    b.load_state_dict(a.state_dict())
    b[0].to(memory_format=torch.channels_last)
    b[1].to(memory_format=torch.channels_last_3d)
    assert not b[0].weight.is_contiguous() and not b[1].weight.is_contiguous()
    weights = lambda m: [m[0].weight, m[1].weight]  # noqa: E731
    kw = dict(algorithm=algorithm, flatten=True, lr=0.02)
    oa, ob = dion3.Dion3([dict(params=weights(a), **kw)]), dion3.Dion3([dict(params=weights(b), **kw)])
    tol = dict(rtol=0, atol=0) if algorithm == "adamw" else dict(rtol=1e-5, atol=1e-6)

    def step(t):
        g = torch.Generator(device="cpu").manual_seed(t)
        for pa, pb in zip(weights(a), weights(b)):
            grad = torch.randn(pa.shape, generator=g).to(device)
            pa.grad = grad
            pb.grad = grad.clone(memory_format=torch.preserve_format).contiguous(
                memory_format=torch.channels_last if pa.dim() == 4 else torch.channels_last_3d)
        oa.step()
        ob.step()
        for pa, pb in zip(weights(a), weights(b)):
            torch.testing.assert_close(pb.detach(), pa.detach(), **tol, msg=f"step {t}")

    for t in range(3):
        step(t)
    assert not ob._given_grads  # the engine reads the gradients itself, as for contiguous weights
    state = ob.state[b[0].weight]["momentum"]
    assert state.is_contiguous(memory_format=torch.channels_last)
    oa.load_state_dict(ob.state_dict())  # channels-last state into the contiguous model's optimizer
    step(3)
    b.to(memory_format=torch.contiguous_format)  # back: the next step plans anew
    step(4)


@pytest.mark.parametrize("algorithm", ["dion3", "adamw"])
def test_a_step_counts_as_an_in_place_update_for_autograd(device, algorithm):
    # As torch.optim's in-place updates do: a backward through a graph that saved the weights
    # before the step (a GAN's generator loss after the discriminator's step) is refused rather
    # than run on the stepped weights.
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(8, 8, device=device))
    opt = dion3.Dion3([dict(params=[w], algorithm=algorithm)], lr=0.01)
    x = torch.randn(4, 8, device=device, requires_grad=True)
    loss = (x @ w).square().sum()
    w.grad = torch.randn_like(w)
    version = w._version
    opt.step()
    assert w._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    w.grad = None
    loss = (x @ w).square().sum()
    opt.step()  # no gradient: nothing stepped
    loss.backward()


@pytest.mark.parametrize("algorithm,switch_to", [("dion3", "normuon"), ("adamw", "lion")])
def test_built_loaded_or_first_stepped_under_inference_mode_then_trains(device, algorithm, switch_to):
    # torch.optim makes its state at the first step, so a factory under torch.inference_mode builds
    # an optimizer that trains; dion3's state, made at construction, at a frozen parameter's or a
    # switched group's first step, or by a load, must not be inference tensors either. Steps equal
    # those of one built, loaded and stepped plainly.
    def run(inference):
        torch.manual_seed(0)
        a, b, c, d = (nn.Parameter(torch.randn(16, 8, device=device)) for _ in range(4))
        c.requires_grad_(False)
        with torch.inference_mode(inference):
            opt = dion3.Dion3([dict(params=[a, c], algorithm=algorithm)], lr=0.01)
            opt.add_param_group(dict(params=[b], algorithm=algorithm))
            opt.add_param_group(dict(params=[d], algorithm=algorithm))
        c.requires_grad_(True)
        opt.param_groups[2]["algorithm"] = switch_to  # fresh state at its first step
        for step in range(4):
            for p in (a, b, c, d):
                p.grad = torch.randn_like(p)
            with torch.inference_mode(inference and step in (0, 2)):
                if step == 2:
                    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
                opt.step()
        return [p.detach().clone() for p in (a, b, c, d)]

    for plain, built in zip(run(False), run(True)):
        assert torch.equal(plain, built)


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


def _thread_ticks():
    """CPU time (clock ticks) each thread of this process has used so far, by thread id."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # from field 3 (state) on
        except OSError:
            continue  # the thread has just ended
        out[int(tid)] = int(fields[11]) + int(fields[12])  # utime + stime
    return out


def _openblas():
    """The OpenBLAS that dion3 links, where it is one (its thread controls), else None."""
    try:
        lib = ctypes.CDLL("libopenblas.so.0")
        lib.openblas_get_num_threads.restype = ctypes.c_int
        return lib
    except (OSError, AttributeError):
        return None


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc/self/task")
def test_cpu_step_keeps_to_torch_thread_count():
    # dion3's CPU work runs on PyTorch's intra-op threads: under torch.set_num_threads(1) the step
    # runs on the calling thread alone, with OpenBLAS's own thread pool (here at two threads) idle.
    threads, blas = torch.get_num_threads(), _openblas()
    blas_threads = blas.openblas_get_num_threads() if blas else 0
    torch.set_num_threads(1)
    if blas:
        blas.openblas_set_num_threads(2)
    try:
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(512, 512) * 0.02) for _ in range(4)]
        opt = dion3.Dion3(params, lr=0.01, fraction=1.0)  # whole 512 x 512 products
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()  # buffers allocated, libraries warmed up
        self_tid = threading.get_native_id()
        before = _thread_ticks()
        mine = others = 0
        for _ in range(20):
            opt.step()
            now = _thread_ticks()
            mine = now[self_tid] - before[self_tid]
            others = sum(t - before.get(tid, 0) for tid, t in now.items() if tid != self_tid)
            if mine >= 30:  # the calling thread has worked 0.3 s
                break
        assert mine >= 30, "the steps took too little time to tell"
        assert others <= 2, f"other threads worked {others} ticks while the calling thread worked {mine}"
        if blas:
            assert blas.openblas_get_num_threads() == 2  # dion3 put OpenBLAS's setting back
    finally:
        torch.set_num_threads(threads)
        if blas:
            blas.openblas_set_num_threads(blas_threads)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
def test_one_openmp_runtime_serves_torch_and_dion3():
    # One thread pool for both: dion3's extension uses the OpenMP runtime PyTorch loaded. In a
    # fresh process with torch and dion3 alone (other tests import libraries that bring their own).
    code = (
        "import json, re, torch, dion3\n"
        "p = torch.nn.Parameter(torch.randn(64, 32)); p.grad = torch.randn_like(p)\n"
        "dion3.Dion3([p]).step()\n"
        "maps = open('/proc/self/maps').read().splitlines()\n"
        "print(json.dumps(sorted({l.split()[-1] for l in maps if re.search(r'/lib(g|i)?omp[^/]*\\.so', l)})))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    runtimes = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(runtimes) == 1, runtimes


def test_step_phases_appear_in_torch_profiler(device):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, 32, device=device))
    b = torch.nn.Parameter(torch.randn(16, device=device))
    opt = dion3.Dion3([dict(params=[w]), dict(params=[b], algorithm="adamw")])
    for p in (w, b):
        p.grad = torch.randn_like(p)
    opt.step()  # builds the engine outside the profiled step
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    names = {e.name for e in prof.events()}
    if device.type == "cuda":  # the engine's kernels show on the GPU's timeline beside the ranges
        gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert gpu, "no CUDA kernels in the profile"
    for phase in ("dion3::step", "dion3::check", "dion3::prepare", "dion3::orthogonalize", "dion3::update",
                  "dion3::elementwise"):
        assert phase in names, (phase, sorted(n for n in names if "dion3" in n or "megabatch" in n))
    assert any(n.startswith("megabatch 0 (1 x 16x32") for n in names)


def test_unchanged_groups_are_not_pushed_again_and_changed_ones_are():
    p = torch.nn.Parameter(torch.randn(8, 6))
    opt = dion3.Dion3([dict(params=[p], lr=0.02), ], fraction=0.5)
    p.grad = torch.randn_like(p)
    opt.step()

    class Counting:
        def __init__(self, engine):
            self.engine, self.pushes = engine, 0

        def update_group(self, i, cfg):
            self.pushes += 1
            return self.engine.update_group(i, cfg)

        def __getattr__(self, name):
            return getattr(self.engine, name)

    counting = Counting(opt._engine)
    opt._engine = counting
    opt.step()
    opt.step()
    assert counting.pushes == 1  # the first push to this engine; then nothing changed
    opt.param_groups[0]["lr"] = 0.01
    opt.step()
    opt.param_groups[0]["betas"] = (0.8, 0.9)
    opt.step()
    assert counting.pushes == 3
    opt.param_groups[0]["coefficients"] = [list(c) for c in dion3.optimizer.POLAR_EXPRESS]  # lists: mutable
    opt.step()
    opt.param_groups[0]["coefficients"][0][0] = 7.0  # edited in place: still reaches the engine
    opt.step()
    assert counting.pushes == 5
    w = p.detach().clone()
    opt.param_groups[0]["lr"] = 0.0
    opt.param_groups[0]["weight_decay"] = 0.0
    opt.step()
    assert torch.equal(p, w)  # lr 0 took effect


@pytest.mark.parametrize("how", ["replace tensors", "new dicts", "state.clear()", "new state mapping"])
def test_state_edits_between_steps_are_followed(how):
    # torch optimizers read self.state[p] at every step; so does dion3's engine registration: a
    # state replaced between steps is what the next step updates (here: fresh state, which must
    # match a fresh optimizer started from the same weights), not the tensors it replaced.
    import collections

    def make(w, b):
        return dion3.Dion3([dict(params=[w]), dict(params=[b], algorithm="adamw", lr=1e-2)], lr=0.02)

    def step(w, b, opt, t):
        g = torch.Generator().manual_seed(t)
        w.grad, b.grad = torch.randn(8, 8, generator=g), torch.randn(8, generator=g)
        opt.step()

    torch.manual_seed(0)
    w, b = nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(8))
    opt = make(w, b)
    for t in range(3):
        step(w, b, opt, t)
    w2, b2 = nn.Parameter(w.detach().clone()), nn.Parameter(b.detach().clone())
    fresh = make(w2, b2)
    old = opt.state[w]["momentum"]
    if how == "replace tensors":
        for p in (w, b):
            for k, v in list(opt.state[p].items()):
                opt.state[p][k] = torch.zeros_like(v) if torch.is_tensor(v) else 0
    elif how == "new dicts":
        opt.state[w], opt.state[b] = {}, {}
    elif how == "state.clear()":
        opt.state.clear()
    else:
        opt.state = collections.defaultdict(dict)
    for t in range(3, 5):
        step(w, b, opt, t)
        step(w2, b2, fresh, t)
    assert torch.equal(w, w2) and torch.equal(b, b2)
    assert opt.state[w]["momentum"] is not old and torch.equal(opt.state[w]["momentum"], fresh.state[w2]["momentum"])
    assert opt.state[w]["step"] == 2


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("swap", [False, True])
def test_model_cast_after_a_step_takes_its_state_along(device, swap):
    # model.to(dtype) or model.to(device) after steps: the next step casts or moves each state
    # tensor to what the parameter now needs, as load_state_dict would, and trains on, equal to
    # an optimizer that went through a state_dict round trip after the same cast. In PyTorch's
    # swap mode too (the parameters keep their objects, which get new tensors): the engine holds
    # no reference to the tensors that would make torch.utils.swap_tensors refuse them.
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        _cast_after_steps(device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


def test_channels_last_weights_cast_in_swap_mode_after_a_step(device):
    # The engine's view of a channels-last weight in memory order references no parameter, so
    # swap_tensors can replace the parameter's tensor; the next step follows it.
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 6 * 6, 4)).to(device)
        model[0].to(memory_format=torch.channels_last)
        opt = dion3.Dion3(dion3.param_groups(model), lr=0.02, flatten=True)
        model(torch.randn(2, 3, 8, 8, device=device)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        model.to(torch.bfloat16)
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        before = model[0].weight.detach().clone()
        model(torch.randn(2, 3, 8, 8, device=device, dtype=torch.bfloat16)).square().mean().backward()
        opt.step()
        assert not torch.equal(model[0].weight, before)
        assert opt.state[model[0].weight]["momentum"].dtype == torch.bfloat16
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


def _cast_after_steps(device):
    def run(round_trip):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
        opt = dion3.Dion3(dion3.param_groups(model), lr=0.02, fraction=0.5)

        def step(t):
            g = torch.Generator().manual_seed(t)
            x = torch.randn(4, 16, generator=g).to(device=next(model.parameters()).device,
                                                   dtype=next(model.parameters()).dtype)
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

        for t in range(2):
            step(t)
        model.to(device=device, dtype=torch.bfloat16)
        if round_trip:
            opt.load_state_dict(opt.state_dict())
        for t in range(2, 4):
            step(t)
        return model, opt

    model, opt = run(False)
    want, _ = run(True)
    for p, q in zip(model.parameters(), want.parameters()):
        assert p.dtype == torch.bfloat16 and p.device.type == device and torch.equal(p, q)
    for p in model.parameters():
        for k, t in opt.state[p].items():
            if torch.is_tensor(t) and k != "step":
                assert t.device == p.device, k
                if k in ("momentum", "exp_avg"):
                    assert t.dtype == torch.bfloat16, (k, t.dtype)


def test_engines_are_released_before_the_interpreter_tears_down(tmp_path):
    # An optimizer still alive at exit (a global, or one freed only by the cycle collector) holds
    # its engine, and with it the process groups its communicators hold; freed in the
    # interpreter's teardown, a gloo group can abort the process. dion3's exit hook releases
    # every engine first: a hook registered before dion3's runs after it and counts none left.
    out = tmp_path / "live"
    script = (
        "import atexit, sys\n"
        "def late():\n"
        "    from dion3 import _C\n"
        "    open(sys.argv[1], 'w').write(str(_C._live_engines()))\n"
        "atexit.register(late)\n"
        "import torch, dion3\n"
        "ps = [torch.nn.Parameter(torch.randn(8, 6)) for _ in range(2)]\n"
        "opt = dion3.Dion3(ps, lr=0.02)\n"
        "for p in ps:\n"
        "    p.grad = torch.randn(8, 6)\n"
        "opt.step()\n"
        "opt.step()\n"
        "assert dion3._C._live_engines() == 1\n"
    )
    r = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert out.read_text() == "0", "an engine outlived dion3's exit hook"


@pytest.mark.parametrize("make", [lambda ps: dion3.Dion3(ps, lr=0.02), lambda ps: dion3.Muon(ps, lr=0.02),
                                  lambda ps: dion3.optim.Muon(ps, lr=0.02)])
def test_zero_grad_frees_the_gradients_a_step_read(device, make):
    # As with torch's optimizers, zero_grad(set_to_none=True) frees the last gradients: the engine
    # holds none between blocking steps (two copies at the peak of the next backward otherwise).
    import gc
    import weakref
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(8, 6, device=device))
    opt = make([w])
    for t in range(3):
        w.grad = torch.randn(8, 6, device=device)
        before = w.detach().clone()
        opt.step()
        assert not torch.equal(w.detach(), before)
        freed = weakref.ref(w.grad)
        opt.zero_grad()
        gc.collect()
        assert freed() is None, t
    # A step that raises lets them go as well.
    w.grad = torch.full((8, 6), float("nan"), device=device)
    with pytest.raises(dion3.NonFiniteError):
        opt.step()
    freed = weakref.ref(w.grad)
    opt.zero_grad()
    gc.collect()
    assert freed() is None


def test_optimizer_built_on_meta_parameters_steps_after_to_empty():
    # With the parameter objects kept through to_empty (swap mode, as for DTensor parameters), the
    # zero state made on 'meta' at construction is made again where the parameters now are.
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        for make in (lambda ps: dion3.Muon(ps, lr=0.02), lambda ps: dion3.optim.Muon(ps, lr=0.02)):
            with torch.device("meta"):
                m = nn.Linear(16, 8, bias=False)
            opt = make(list(m.parameters()))
            m.to_empty(device="cpu")
            nn.init.normal_(m.weight)
            before = m.weight.detach().clone()
            m(torch.randn(4, 16)).sum().backward()
            opt.step()
            assert torch.isfinite(m.weight).all() and not torch.equal(m.weight.detach(), before)
            assert all(t.device.type == "cpu" for t in opt.state[m.weight].values() if torch.is_tensor(t))
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


@pytest.mark.parametrize("algorithm", ["adamw", "muon"])
def test_model_cast_that_overflows_its_state_is_refused_by_name(device, algorithm):
    # model.half() after steps whose state exceeds float16's range: the cast state would hold Inf,
    # which the engine refuses as non-finite state the user never wrote. The refusal names the
    # parameter, the state as opt.state[p] shows it and the cast; nothing changes.
    torch.manual_seed(0)
    lin = nn.Linear(8, 8, bias=False).to(device)
    opt = dion3.Muon([dict(params=[lin.weight], param_names=["lin.weight"], algorithm=algorithm)], lr=1e-3)
    lin.weight.grad = torch.full_like(lin.weight, 1e5)
    opt.step()
    lin.half()
    lin.weight.grad = torch.ones_like(lin.weight)
    weight = lin.weight.detach().clone()
    state = {k: v.clone() for k, v in opt.state[lin.weight].items() if torch.is_tensor(v)}
    name = "variance" if algorithm == "adamw" else "momentum"
    with pytest.raises(ValueError, match=rf"parameter 'lin.weight': its state '{name}' \(torch.float32\) holds values "
                                         r"beyond the range of torch.float16.*was the model cast after steps"):
        opt.step()
    assert torch.equal(lin.weight, weight)
    assert all(torch.equal(opt.state[lin.weight][k], v) for k, v in state.items())
    del opt.state[lin.weight]
    opt.step()
    assert opt.state[lin.weight]["step"] == 1 and not torch.equal(lin.weight, weight)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_model_moved_and_narrowed_in_one_call_takes_its_state_along():
    # model.to(device, dtype) after steps: the overflow check of the cast state compares values
    # held on two devices.
    lin = nn.Linear(8, 8, bias=False)
    opt = dion3.Muon([lin.weight], lr=1e-3)
    lin.weight.grad = torch.randn_like(lin.weight)
    opt.step()
    lin.to("cuda", torch.bfloat16)
    lin.weight.grad = torch.randn_like(lin.weight)
    opt.step()
    assert opt.state[lin.weight]["momentum"].device.type == "cuda"


@pytest.mark.parametrize("algorithm,shape", [("dion3", (16, 24)), ("normuon", (16, 24)), ("muon", (16, 24)),
                                             ("dion2", (24, 16))])
def test_matrices_without_a_gradient_are_left_alone_in_the_same_plan(device, algorithm, shape):
    # Experts of a mixture-of-experts layer that get no tokens at some steps: torch.optim's rule (a
    # parameter whose .grad is None is not stepped, its state not touched, its "step" not counted)
    # without planning anew; the other matrices step as each would in an optimizer of its own.
    torch.manual_seed(0)
    experts = [nn.Parameter(torch.randn(shape, device=device) * 0.05) for _ in range(4)]
    alone = [nn.Parameter(e.detach().clone()) for e in experts]
    bias = nn.Parameter(torch.zeros(shape[1], device=device))
    opt = dion3.Dion3([dict(params=experts, algorithm=algorithm), dict(params=[bias], algorithm="adamw")], lr=0.02)
    singles = [dion3.Dion3([dict(params=[a], algorithm=algorithm)], lr=0.02) for a in alone]
    tol = dict(rtol=1e-5, atol=1e-6) if device == "cpu" else dict(rtol=1e-2, atol=1e-3)
    engines = []
    g = torch.Generator().manual_seed(1)
    for step in range(7):
        bias.grad = torch.randn(shape[1], generator=g).to(device)
        kept = {}
        for i, (e, a) in enumerate(zip(experts, alone)):
            grad = torch.randn(shape, generator=g).to(device)
            if step > 0 and (i + step) % 3 == 0:
                e.grad = a.grad = None
                kept[i] = [e.detach().clone()] + [v.clone() for v in opt.state[e].values() if torch.is_tensor(v)]
            else:
                e.grad, a.grad = grad, grad.clone()
                singles[i].step()
        opt.step()
        engines.append(opt._engine)
        for i, before in kept.items():
            after = [experts[i].detach()] + [v for v in opt.state[experts[i]].values() if torch.is_tensor(v)]
            assert all(torch.equal(x, y) for x, y in zip(after, before)), f"expert {i} moved at step {step}"
        for i, (e, a) in enumerate(zip(experts, alone)):
            torch.testing.assert_close(e.detach(), a.detach(), **tol, msg=lambda m: f"expert {i}, step {step}: {m}")
    assert all(x is engines[0] for x in engines), "the optimizer planned anew"
    assert [opt.state[e]["step"] for e in experts] == [s.state[a]["step"] for s, a in zip(singles, alone)]
    assert opt.state[bias]["step"] == 7


def test_an_element_wise_parameter_without_a_gradient_is_not_stepped(device):
    # AdamW counts steps per parameter: a vector without a gradient is left out of a plan made anew
    # (as before), still matching torch.optim.AdamW.
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(8, 12, device=device))
    b = nn.Parameter(torch.randn(12, device=device))
    tb = nn.Parameter(b.detach().clone())
    opt = dion3.Dion3([dict(params=[w]), dict(params=[b], algorithm="adamw", betas=(0.9, 0.95))], lr=0.01)
    ref = torch.optim.AdamW([tb], lr=0.01, betas=(0.9, 0.95), weight_decay=0.01)
    for step in range(4):
        w.grad = torch.randn_like(w)
        grad = None if step == 2 else torch.randn_like(b)
        b.grad, tb.grad = grad, None if grad is None else grad.clone()
        opt.step()
        ref.step()
        torch.testing.assert_close(b.detach(), tb.detach(), rtol=1e-5, atol=1e-6)
    assert opt.state[b]["step"] == 3


def test_a_checkpoint_taken_while_a_matrix_has_no_gradient_resumes_exactly(device):
    torch.manual_seed(0)
    ws = [nn.Parameter(torch.randn(16, 24, device=device) * 0.05) for _ in range(3)]
    opt = dion3.Dion3(ws, lr=0.02)
    g = torch.Generator().manual_seed(2)

    def grads(step):
        return [None if (i + step) % 2 == 0 and step > 0 else torch.randn(16, 24, generator=g).to(device)
                for i in range(3)]

    for step in range(3):
        for w, gr in zip(ws, grads(step)):
            w.grad = gr
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    copies = [nn.Parameter(w.detach().clone()) for w in ws]
    resumed = dion3.Dion3(copies, lr=0.02)
    resumed.load_state_dict(saved)
    for step in range(3, 6):
        gs = grads(step)
        for w, c, gr in zip(ws, copies, gs):
            w.grad, c.grad = gr, None if gr is None else gr.clone()
        opt.step()
        resumed.step()
    assert all(torch.equal(w, c) for w, c in zip(ws, copies))
    assert [opt.state[w]["step"] for w in ws] == [resumed.state[c]["step"] for c in copies]


def _count_builds(opt):
    """A list that gains an entry whenever opt makes an engine (plans anew)."""
    builds, rebuild = [], opt._rebuild
    opt._rebuild = lambda *a, **k: (builds.append(len(builds)), rebuild(*a, **k))[1]
    return builds


def test_the_plan_holds_every_matrix_that_requires_a_gradient(device):
    # Matrices without a gradient when a plan is made (at the first step, after an AdamW vector's
    # gradient came or went, after load_state_dict) are in it: later steps with other experts
    # missing plan nothing anew. A step with no gradient at all keeps the plan too.
    torch.manual_seed(0)
    experts = [nn.Parameter(torch.randn(8, 12, device=device) * 0.05) for _ in range(6)]
    bias = nn.Parameter(torch.zeros(12, device=device))
    frozen = nn.Parameter(torch.randn(8, 12, device=device), requires_grad=False)
    groups = [dict(params=experts + [frozen]), dict(params=[bias], algorithm="adamw")]
    opt = dion3.Dion3(groups, lr=0.02)
    builds = _count_builds(opt)
    g = torch.Generator().manual_seed(3)

    def step(t, bias_grad=True):
        for i, e in enumerate(experts):
            e.grad = None if (i + t) % 3 == 0 else torch.randn(8, 12, generator=g).to(device)
        bias.grad = torch.randn(12, generator=g).to(device) if bias_grad else None
        opt.step()

    for t in range(5):  # experts missing from the first step on
        step(t)
    assert len(builds) == 1, builds
    step(5, bias_grad=False)  # an element-wise parameter without a gradient: planned anew
    step(6)  # and again once it has one
    for t in range(7, 11):
        step(t)
    assert len(builds) == 3, builds
    for p in experts + [bias]:
        p.grad = None
    engine = opt._engine
    opt.step()  # nothing to step
    assert opt._engine is engine
    step(11)
    assert len(builds) == 3, builds
    resumed = dion3.Dion3(groups, lr=0.02)
    resumed.load_state_dict(opt.state_dict())
    opt = resumed
    builds = _count_builds(opt)
    for t in range(12, 16):
        step(t)
    assert len(builds) == 1, builds
    assert "step" not in opt.state[frozen] or opt.state[frozen]["step"] == 0


def test_an_optimizer_whose_parameters_never_get_a_gradient_says_why_once():
    # The optimizer built before the model was wrapped (FSDP2's fully_shard gives the model new
    # parameters): every step finds no gradient. torch's optimizers stay silent; dion3 says it once.
    model = nn.Linear(8, 8, bias=False)
    opt = dion3.Dion3(model.parameters(), lr=0.02)
    model.weight = nn.Parameter(model.weight.detach().clone())  # what wrapping does
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
    said = [w for w in caught if "no parameter of this optimizer has had a gradient" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    fine = dion3.Dion3(model.parameters(), lr=0.02)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fine.step()  # no backward yet: nothing to say
        for _ in range(4):
            model(torch.randn(2, 8)).sum().backward()
            fine.step()
            model.weight.grad = None
            fine.step()
    assert not [w for w in caught if "has had a gradient" in str(w.message)]


def test_a_step_from_a_second_thread_while_one_runs_is_refused():
    # The engine steps without the GIL: a second thread's step beneath it would rebind the
    # gradients (freed memory, NaN weights). It raises instead, and the running step ends as if alone.
    torch.manual_seed(0)
    ws = [nn.Parameter(torch.randn(64, 48)) for _ in range(2)]
    grads = [torch.randn(64, 48) for _ in ws]
    alone = dion3.Dion3([w.detach().clone().requires_grad_() for w in ws], lr=0.02)
    for p, g in zip(alone.param_groups[0]["params"], grads):
        p.grad = g.clone()
    alone.step()
    opt = dion3.Dion3(ws, lr=0.02)
    inside, release, errors = threading.Event(), threading.Event(), []

    def closure():  # runs inside the first thread's step
        for p, g in zip(ws, grads):
            p.grad = g.clone()
        inside.set()
        release.wait(30)

    t = threading.Thread(target=lambda: opt.step(closure))
    t.start()
    assert inside.wait(30)
    try:
        opt.step()
    except RuntimeError as e:
        errors.append(str(e))
    release.set()
    t.join(30)
    assert errors and "stepping in another thread" in errors[0]
    assert all(torch.equal(a, b) for a, b in zip(ws, alone.param_groups[0]["params"]))
    assert [opt.state[w]["step"] for w in ws] == [1, 1]


def test_engine_calls_from_another_thread_during_a_native_step_are_refused():
    # The guard at the engine itself: while one thread's step runs natively (GIL released), a
    # call that reaches the engine from another thread raises rather than racing it.
    torch.manual_seed(0)
    ws = [nn.Parameter(torch.randn(512, 512)) for _ in range(4)]
    opt = dion3.Dion3(ws, lr=0.02, fraction=1.0)
    for w in ws:
        w.grad = torch.randn(512, 512)
    opt.step()  # builds the engine
    engine, done, refused = opt._engine, threading.Event(), []

    def steps():
        for _ in range(5):
            opt.step()
        done.set()

    t = threading.Thread(target=steps)
    t.start()
    while not done.is_set():
        try:
            engine.steps_taken
        except RuntimeError as e:
            refused.append(str(e))
    t.join(60)
    assert refused and "in use by another thread" in refused[0]
    assert engine.steps_taken == 6 and all(torch.isfinite(w).all() for w in ws)


def test_a_cycle_through_a_stepped_optimizer_is_collected():
    # A parameter's hook that refers to the optimizer makes a cycle through the engine, which
    # holds the parameters, their state dicts and the groups: the collector sees those references.
    import gc
    import weakref

    def build():
        p = nn.Parameter(torch.randn(64, 32))
        opt = dion3.Dion3([p], lr=0.02)
        p.register_hook(lambda g: (opt, g)[1])
        (p * 2).sum().backward()
        opt.step()
        return weakref.ref(opt)

    gc.collect()
    before = dion3._C._live_engines()
    refs = [build() for _ in range(3)]
    gc.collect()
    assert all(r() is None for r in refs)
    assert dion3._C._live_engines() == before


def test_a_step_interrupted_right_after_the_engine_returns_is_counted():
    # A signal (KeyboardInterrupt) lands once the native step returns: the weights have stepped,
    # so the counters a checkpoint saved in the handler holds must say so.
    torch.manual_seed(0)
    w, b = nn.Parameter(torch.randn(32, 16)), nn.Parameter(torch.randn(16))
    opt = dion3.Dion3([dict(params=[w]), dict(params=[b], algorithm="adamw")], lr=0.02)
    ref = dion3.Dion3([dict(params=[w.detach().clone().requires_grad_()]),
                       dict(params=[b.detach().clone().requires_grad_()], algorithm="adamw")], lr=0.02)
    for o, (pw, pb) in ((opt, (w, b)), (ref, ref.param_groups[0]["params"] + ref.param_groups[1]["params"])):
        pw.grad, pb.grad = torch.ones(32, 16), torch.ones(16)
        o.step()
    _interrupt_once(opt, "_run_first", after=True)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    ref.step()
    sd = opt.state_dict()
    assert [st["step"] for st in sd["state"].values()] == [2, 2]
    assert torch.equal(w, ref.param_groups[0]["params"][0]) and torch.equal(b, ref.param_groups[1]["params"][0])
    assert opt.state[b]["step"] == 2


def test_an_interrupted_step_is_counted_for_its_own_parameters():
    # The cut-short count is folded before the next step runs, with the parameters that step had:
    # a matrix without a gradient then is not credited with it.
    torch.manual_seed(0)
    w, v = nn.Parameter(torch.randn(16, 8)), nn.Parameter(torch.randn(16, 8))
    opt = dion3.Dion3([w, v], lr=0.02)
    w.grad, v.grad = torch.randn(16, 8), torch.randn(16, 8)
    opt.step()
    _interrupt_once(opt, "_run_first", after=True)
    w.grad, v.grad = None, torch.randn(16, 8)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    w.grad, v.grad = torch.randn(16, 8), torch.randn(16, 8)
    opt.step()
    assert [opt.state[p]["step"] for p in (w, v)] == [2, 3]


def test_a_reader_in_another_thread_waits_for_the_step_to_count():
    # A read of the counters (steps_skipped, state_dict) from a logging thread while a step runs
    # waits for it: folded in the middle, the step's count was lost.
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(64, 32))
    opt = dion3.Dion3([w], lr=0.02)
    w.grad = torch.randn(64, 32)
    opt.step()
    run_first, inside, read = opt._run_first, threading.Event(), threading.Event()

    def paused(engine, asynchronous):  # the step's count is pending; the engine has not run
        inside.set()
        read.wait(1)
        return run_first(engine, asynchronous)

    opt._run_first = paused

    def reader():
        inside.wait(10)
        opt.steps_skipped
        read.set()

    t = threading.Thread(target=reader)
    t.start()
    w.grad = torch.randn(64, 32)
    opt.step()
    t.join(10)
    del opt._run_first
    assert [st["step"] for st in opt.state_dict()["state"].values()] == [2]


def _interrupt_once(opt, name, after=False, skip=0):
    """Make opt.<name> raise KeyboardInterrupt at its call after `skip` others (having run, with
    after): a signal landing there."""
    real, calls = getattr(opt, name), []

    def once(*args, **kwargs):
        calls.append(1)
        if len(calls) <= skip:
            return real(*args, **kwargs)
        delattr(opt, name)
        if after:
            real(*args, **kwargs)
        raise KeyboardInterrupt
    setattr(opt, name, once)


@pytest.mark.parametrize("where", ["before the fold commits", "after it commits", "after the engine, then deepcopy"])
def test_a_count_cut_short_anywhere_is_folded_once(where):
    # A signal lands in the count of a step that ran: not yet committed (folded again later),
    # committed but not written (written again), or right after the engine (folded by a copy).
    torch.manual_seed(0)
    w, b = nn.Parameter(torch.randn(16, 8)), nn.Parameter(torch.randn(8))

    def build(w, b):
        return dion3.Dion3([dict(params=[w]), dict(params=[b], algorithm="adamw")], lr=0.02)
    opt = build(w, b)
    rw, rb = (nn.Parameter(t.detach().clone()) for t in (w, b))
    ref = build(rw, rb)
    for step in range(3):
        for o, (pw, pb) in ((opt, (w, b)), (ref, (rw, rb))):
            pw.grad, pb.grad = torch.full((16, 8), 0.1 * (step + 1)), torch.full((8,), 0.1 * (step + 1))
        if step == 1:
            if where == "before the fold commits":
                _interrupt_once(opt, "_counted_states")
            elif where == "after it commits":
                _interrupt_once(opt, "_finish_bumps", skip=1)  # the fold's, not the step's first
            else:
                _interrupt_once(opt, "_run_first", after=True)
            with pytest.raises(KeyboardInterrupt):
                opt.step()
            if where.endswith("deepcopy"):
                opt = copy.deepcopy(opt)
                w, b = opt.param_groups[0]["params"][0], opt.param_groups[1]["params"][0]
        else:
            opt.step()
        ref.step()
    assert [st["step"] for st in opt.state_dict()["state"].values()] == [3, 3]
    assert torch.equal(w, rw) and torch.equal(b, rb)


def test_a_thread_reading_the_counters_does_not_make_steps_fail():
    # Readers (a logging thread's steps_skipped or state_dict) wait for a running step's body; the
    # training thread's steps never see them as a second stepping thread.
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(32, 16))
    opt = dion3.Dion3([w], lr=0.02, on_nonfinite="skip")
    stop, errors = threading.Event(), []

    def reader():
        while not stop.is_set():
            try:
                opt.steps_skipped
                opt.state_dict()
            except Exception as e:  # noqa: BLE001 - any error is the finding
                errors.append(repr(e))
    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(200):
            w.grad = torch.full((32, 16), float("nan")) if i % 7 == 3 else torch.randn(32, 16)
            opt.step()
    finally:
        stop.set()
        t.join(30)
    assert not errors
    assert opt.state[w]["step"] == 200 - len([i for i in range(200) if i % 7 == 3]) and opt.steps_skipped == 29
