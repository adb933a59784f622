# test_cuda_graph.py — dion3.cuda_graph.CudaGraphOptimizer (replayed steps equal eager steps bit for
# bit while lr and weight decay change every step) and the step that does not wait for the GPU.
# CUDA only: skipped where dion3 has no GPU (the device run sets DION3_REQUIRE_CUDA=1).
import warnings

import pytest
import torch

import dion3
from conftest import DEVICES

pytestmark = pytest.mark.skipif("cuda" not in DEVICES, reason="needs a GPU and a CUDA build")

SHAPES = [(96, 64), (96, 64), (64, 160), (40, 64)]


def _model(seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mats = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=g).to(dtype) * 0.05) for s in SHAPES]
    vecs = [torch.nn.Parameter(torch.randn(64, device="cuda", generator=g).to(dtype)) for _ in range(2)]
    return mats, vecs


def _grads(step, params):
    g = torch.Generator(device="cuda").manual_seed(100 + step)
    return [torch.randn(p.shape, device="cuda", generator=g).to(p.dtype) for p in params]


def _same_grads(step, eager_params, graph_params):
    """Step `step`'s gradients: new tensors on the eager side, copied into the graph side's own."""
    for p, q, g in zip(eager_params, graph_params, _grads(step, eager_params)):
        p.grad = g.clone()
        q.grad.copy_(g)


def _schedule(opt, step):
    for i, group in enumerate(opt.param_groups):  # every step, every group: lr and weight decay
        group["lr"] = (0.02 if i == 0 else 1e-3) * (1.0 - 0.07 * step)
        group["weight_decay"] = 0.01 * (1 + step % 3)
    opt.param_groups[0]["mu"] = 0.95 - 0.01 * (step % 2)  # momentum too


@pytest.mark.parametrize("fraction", [0.25, 1.0])
def test_replayed_steps_equal_eager_steps_bit_for_bit_over_a_schedule(fraction):
    eager_p, graph_p = _model(), _model()
    eager = dion3.Dion3([dict(params=eager_p[0]), dict(params=eager_p[1], algorithm="adamw", lr=1e-3)],
                        lr=0.02, fraction=fraction)
    inner = dion3.Dion3([dict(params=graph_p[0]), dict(params=graph_p[1], algorithm="adamw", lr=1e-3)],
                        lr=0.02, fraction=fraction)
    wrapped = dion3.cuda_graph.CudaGraphOptimizer(inner, warmup_steps=2)
    ea, ga = eager_p[0] + eager_p[1], graph_p[0] + graph_p[1]
    for p in ga:
        p.grad = torch.zeros_like(p)  # stable gradient tensors, filled in place
    for step in range(8):
        _same_grads(step, ea, ga)
        _schedule(eager, step)
        _schedule(wrapped, step)
        eager.step()
        wrapped.step()
        assert wrapped.captured == (step >= 2)
        for i, (p, q) in enumerate(zip(ea, ga)):
            assert torch.equal(p, q), f"parameter {i} differs at step {step} (captured: {wrapped.captured})"
    for p, q in zip(ea, ga):
        for k, v in eager.state[p].items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, inner.state[q][k]), k
    assert wrapped.state_dict()["state"][0]["step"] == 8  # counters of replayed steps come back
    wrapped.release()


def test_an_lr_scheduler_drives_the_replayed_step():
    eager_p, graph_p = _model(1), _model(1)
    eager = dion3.Dion3(eager_p[0], lr=0.02)
    wrapped = dion3.cuda_graph.CudaGraphOptimizer(dion3.Dion3(graph_p[0], lr=0.02), warmup_steps=1)
    s1 = torch.optim.lr_scheduler.LambdaLR(eager, lambda t: 1.0 / (1 + t))
    s2 = torch.optim.lr_scheduler.LambdaLR(wrapped, lambda t: 1.0 / (1 + t))
    for p in graph_p[0]:
        p.grad = torch.zeros_like(p)
    for step in range(5):
        _same_grads(step, eager_p[0], graph_p[0])
        eager.step()
        wrapped.step()
        s1.step()
        s2.step()
        assert all(torch.equal(p, q) for p, q in zip(eager_p[0], graph_p[0])), step
    wrapped.release()


def test_capture_refuses_a_parameter_without_gradient_and_recaptures_after_a_plan_change():
    mats, _ = _model(2)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in mats]
    eager = dion3.Dion3(twins, lr=0.02)
    wrapped = dion3.cuda_graph.CudaGraphOptimizer(dion3.Dion3(mats, lr=0.02), warmup_steps=1)
    for p, q in zip(mats[:3], twins[:3]):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    wrapped.step()  # eager
    eager.step()
    with pytest.raises(RuntimeError, match=r"parameter 3 'group0.param3' of group 0 requires grad but has no gradient"):
        wrapped.step()
    mats[3].grad = torch.randn_like(mats[3])
    twins[3].grad = mats[3].grad.clone()
    # One process plans every parameter from the first step (a gradient that is absent is read so
    # on the device): its arrival needs no eager step before the capture, which steps all four.
    wrapped.step()
    eager.step()
    assert wrapped.captured
    assert all(torch.equal(p, q) for p, q in zip(mats, twins))
    wrapped.param_groups[0]["fraction"] = 0.5  # the plan changes: the graph cannot follow
    wrapped.step()
    assert not wrapped.captured
    assert {mb["selected_rows"] for mb in wrapped.plan()} == {48, 32, 20}
    wrapped.release()


def test_a_weight_or_state_tensor_moved_to_other_storage_is_captured_again():
    # The graph writes where the tensors were at capture: after .data = ... on a weight or a state
    # tensor the wrapper steps eagerly (into the new storage) and captures again, as the eager
    # optimizer beside it shows.
    eager_p, graph_p = _model(3), _model(3)
    eager = dion3.Dion3(eager_p[0], lr=0.02)
    inner = dion3.Dion3(graph_p[0], lr=0.02)
    wrapped = dion3.cuda_graph.CudaGraphOptimizer(inner, warmup_steps=1)
    for p in graph_p[0]:
        p.grad = torch.zeros_like(p)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(6):
            _same_grads(step, eager_p[0], graph_p[0])
            if step == 3:
                graph_p[0][0].data = graph_p[0][0].data.clone()
            if step == 4:
                inner.state[graph_p[0][1]]["momentum"].data = inner.state[graph_p[0][1]]["momentum"].data.clone()
            eager.step()
            wrapped.step()
            assert wrapped.captured == (step in (1, 2, 5)), step
            assert all(torch.equal(p, q) for p, q in zip(eager_p[0], graph_p[0])), step
    # The declined captures (steps 3 and 4) recorded nothing, and say nothing of it.
    assert not [w for w in seen if "CUDA Graph is empty" in str(w.message)]
    for p, q in zip(eager_p[0], graph_p[0]):
        assert torch.equal(eager.state[p]["momentum"], inner.state[q]["momentum"])
    wrapped.release()


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_a_step_that_does_not_wait_drops_a_bad_step_and_reports_it(policy):
    mats, vecs = _model(3)
    opt = dion3.Dion3([dict(params=mats), dict(params=vecs, algorithm="adamw", lr=1e-3)], lr=0.02,
                      on_nonfinite=policy, blocking=False)
    params = mats + vecs
    for p, g in zip(params, _grads(0, params)):
        p.grad = g
    opt.step()
    before = [p.detach().clone() for p in params]
    params[1].grad[3, 5] = float("nan")
    opt.step()  # returns at once; the GPU drops the step
    torch.cuda.synchronize()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    if policy == "skip":
        assert opt.steps_skipped == 1
        assert opt.state_dict()["state"][0]["step"] == 1
    else:
        with pytest.raises(dion3.NonFiniteError, match="1 earlier step"):
            opt.check_nonfinite()
        assert opt.steps_skipped == 0  # raised, not skipped
    params[1].grad = torch.randn_like(params[1])
    opt.step()
    opt.check_nonfinite()
    assert opt.state_dict()["state"][0]["step"] == 2


def test_a_step_captured_by_hand_follows_refresh_hyperparameters():
    eager_p, graph_p = _model(4), _model(4)
    eager = dion3.Dion3(eager_p[0], lr=0.02)
    opt = dion3.Dion3(graph_p[0], lr=0.02)
    for p, q, g in zip(eager_p[0], graph_p[0], _grads(0, eager_p[0])):
        p.grad, q.grad = g.clone(), g.clone()
    eager.step()
    opt.step()  # eager: builds the engine and writes the hyper-parameters once
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for step in range(1, 4):
        for p, q, g in zip(eager_p[0], graph_p[0], _grads(step, eager_p[0])):
            p.grad.copy_(g)
            q.grad.copy_(g)
        for o in (eager, opt):
            o.param_groups[0]["lr"] = 0.02 / (1 + step)
        eager.step()
        opt.refresh_hyperparameters()
        graph.replay()
        assert all(torch.equal(p, q) for p, q in zip(eager_p[0], graph_p[0])), step


def _after_small_steps():
    """A Dion3 matrix after two applied steps of small gradients: its momentum bound is known."""
    p = torch.nn.Parameter(torch.randn(96, 64, device="cuda") * 0.05)
    opt = dion3.Dion3([p], lr=0.02, on_nonfinite="skip")
    for _ in range(2):
        p.grad = torch.full_like(p, 0.5)
        opt.step()
    return p, opt


def _capture(opt, after=None):
    """A graph of opt.step(), then of after() where given (a write the graph makes after the step)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
        if after is not None:
            after()
    return graph


def _replay(opt, graph):
    opt.refresh_hyperparameters()
    graph.replay()


def test_a_replay_after_an_in_place_state_write_reads_the_momentum():
    # Between replays nothing runs step(): refresh_hyperparameters() notices the in-place write, so
    # the replayed check reads the momentum and drops the step that would overflow it.
    big = torch.finfo(torch.float32).max
    p, opt = _after_small_steps()
    graph = _capture(opt)
    _replay(opt, graph)
    opt.state[p]["momentum"].fill_(0.9 * big)
    p.grad.fill_(0.2 * big)
    before = p.detach().clone()
    _replay(opt, graph)
    torch.cuda.synchronize()
    assert torch.equal(p, before) and torch.isfinite(opt.state[p]["momentum"]).all()


def test_an_in_place_state_write_noticed_under_capture_is_read_by_the_next_eager_step():
    # The step being captured notices the write (its tensor's version moved) and forgets the
    # bounds; the forget must not wait in the graph: the eager step after the capture, never
    # replayed, reads the momentum and drops the step that would overflow it.
    big = torch.finfo(torch.float32).max
    p, opt = _after_small_steps()
    opt.state[p]["momentum"].fill_(0.9 * big)
    p.grad.fill_(0.2 * big)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    before = p.detach().clone()
    opt.step()
    torch.cuda.synchronize()
    assert torch.equal(p, before) and torch.isfinite(opt.state[p]["momentum"]).all()
    assert opt.steps_skipped == 1


def test_a_state_write_captured_after_the_step_is_read_by_every_replay():
    # The graph writes the momentum after its step, and replays move no version: the bound that a
    # replay's step raised does not hold the momentum its write leaves. Every refresh before a
    # replay, and the eager step after one, must have the check read it.
    big = torch.finfo(torch.float32).max
    p, opt = _after_small_steps()
    mom = opt.state[p]["momentum"]
    src = torch.zeros_like(mom)
    graph = _capture(opt, lambda: mom.copy_(src))
    _replay(opt, graph)  # applied; the momentum is then src (zeros)
    src.fill_(0.9 * big)
    _replay(opt, graph)  # applied from a zero momentum, which the graph then sets to 0.9 x the largest
    src.fill_(0.0)
    p.grad.fill_(0.2 * big)  # under the limit of the bound the step raised: only a read stops it
    before = p.detach().clone()
    _replay(opt, graph)  # dropped; the graph's write leaves zeros
    torch.cuda.synchronize()
    assert torch.equal(p, before) and opt.steps_skipped == 1
    src.fill_(0.9 * big)
    p.grad.fill_(0.5)
    _replay(opt, graph)  # applied from zeros; momentum 0.9 x the largest
    p.grad.fill_(0.2 * big)
    before = p.detach().clone()
    opt.step()  # eager, after a replay
    torch.cuda.synchronize()
    assert torch.equal(p, before) and opt.steps_skipped == 2


def test_a_state_write_captured_after_the_step_is_read_after_an_eager_step_or_a_new_capture():
    # The same write, seen first by an eager step between the capture and its first replay; then a
    # capture of another graph right after replays of the first, whose last write must be read.
    big = torch.finfo(torch.float32).max
    p, opt = _after_small_steps()
    mom = opt.state[p]["momentum"]
    src = torch.full_like(mom, 0.9 * big)
    graph = _capture(opt, lambda: mom.copy_(src))
    opt.step()  # eager: the momentum is the small one (the capture wrote nothing yet)
    _replay(opt, graph)  # applied; momentum 0.9 x the largest
    src.fill_(0.0)
    p.grad.fill_(0.2 * big)
    before = p.detach().clone()
    _replay(opt, graph)  # dropped
    torch.cuda.synchronize()
    assert torch.equal(p, before) and opt.steps_skipped == 1
    src.fill_(0.9 * big)
    p.grad.fill_(0.5)
    _replay(opt, graph)  # applied from zeros; momentum 0.9 x the largest
    other = _capture(opt)
    p.grad.fill_(0.2 * big)
    before = p.detach().clone()
    _replay(opt, other)
    torch.cuda.synchronize()
    assert torch.equal(p, before) and opt.steps_skipped == 2


def test_a_graph_captured_before_the_optimizer_was_rebuilt_is_refused():
    # A new group and an eager step give the optimizer another engine: the graph still points
    # into the old one's buffers, so refresh_hyperparameters() refuses it (capture again).
    p, opt = _after_small_steps()
    _replay(opt, _capture(opt))
    q = torch.nn.Parameter(torch.randn(64, 32, device="cuda"))
    q.grad = torch.randn_like(q)
    opt.add_param_group({"params": [q]})
    opt.step()
    with pytest.raises(RuntimeError, match="capture again"):
        opt.refresh_hyperparameters()
    _capture(opt)  # a new capture is replayable again
    opt.refresh_hyperparameters()


def _pair(seed, warmup_steps, **kwargs):
    """An eager optimizer and a wrapped twin over the same starting weights (matrices and AdamW
    vectors), the twin's gradients allocated once."""
    eager_p, graph_p = _model(seed), _model(seed)
    groups = lambda ps: [dict(params=ps[0]), dict(params=ps[1], algorithm="adamw", lr=1e-3)]  # noqa: E731
    eager = dion3.Dion3(groups(eager_p), lr=0.02, **kwargs)
    wrapped = dion3.cuda_graph.CudaGraphOptimizer(dion3.Dion3(groups(graph_p), lr=0.02, **kwargs),
                                                  warmup_steps=warmup_steps)
    ea, ga = eager_p[0] + eager_p[1], graph_p[0] + graph_p[1]
    for p in ga:
        p.grad = torch.zeros_like(p)
    return eager, wrapped, ea, ga


def _steps_of(opt, n):
    return [opt.state_dict()["state"][i]["step"] for i in range(n)]


def test_a_load_or_a_new_group_through_the_wrapper_is_stepped_eagerly_then_captured():
    eager, wrapped, ea, ga = _pair(5, 1)
    for step in range(3):  # eager, capture, replay
        _same_grads(step, ea, ga)
        eager.step()
        wrapped.step()
    assert wrapped.captured
    saved = eager.state_dict()
    eager.load_state_dict(saved)
    wrapped.load_state_dict(saved)
    for step in range(3, 7):
        _same_grads(step, ea, ga)
        eager.step()
        wrapped.step()  # the first plans the loaded state eagerly, the second captures
        assert wrapped.captured == (step >= 4), step
        assert all(torch.equal(p, q) for p, q in zip(ea, ga)), step
    w = torch.randn(64, 48, device="cuda", dtype=torch.bfloat16)
    extra = [torch.nn.Parameter(w.clone()) for _ in range(2)]  # one for each optimizer, equal
    extra[1].grad = torch.zeros_like(extra[1])
    eager.add_param_group(dict(params=[extra[0]]))
    wrapped.add_param_group(dict(params=[extra[1]]))
    for step in range(7, 10):
        _same_grads(step, ea + extra[:1], ga + extra[1:])
        eager.step()
        wrapped.step()
        assert wrapped.captured == (step >= 8), step
        assert all(torch.equal(p, q) for p, q in zip(ea + extra[:1], ga + extra[1:])), step
    assert _steps_of(wrapped, len(ga) + 1) == _steps_of(eager, len(ea) + 1)
    wrapped.release()


def test_a_plan_change_at_the_step_the_wrapper_captures_is_stepped_eagerly():
    eager, wrapped, ea, ga = _pair(6, 2)
    for step in range(5):
        _same_grads(step, ea, ga)
        if step == 2:  # the step the wrapper would capture
            eager.param_groups[0]["fraction"] = wrapped.param_groups[0]["fraction"] = 0.5
        eager.step()
        wrapped.step()
        assert wrapped.captured == (step >= 3), step
        assert all(torch.equal(p, q) for p, q in zip(ea, ga)), step
    wrapped.release()


def test_a_capture_before_the_first_step_is_declined_with_nothing_enqueued():
    eager_p, graph_p = _model(7), _model(7)
    eager, opt = dion3.Dion3(eager_p[0], lr=0.02), dion3.Dion3(graph_p[0], lr=0.02)
    for p, q, g in zip(eager_p[0], graph_p[0], _grads(0, eager_p[0])):
        p.grad, q.grad = g.clone(), g.clone()
    graph = torch.cuda.CUDAGraph()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's warning of an empty graph
        with pytest.raises(dion3.optimizer.CaptureNotReady, match="run one eager step before capturing"):
            with torch.cuda.graph(graph):
                opt.step()
    for step in range(3):
        for p, q, g in zip(eager_p[0], graph_p[0], _grads(step, eager_p[0])):
            p.grad, q.grad = g.clone(), g.clone()
        eager.step()
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(eager_p[0], graph_p[0]))


def test_new_gradient_tensors_between_replays_are_not_left_unread():
    # model.zero_grad() (set_to_none) and a backward give each parameter a new .grad: the graph
    # reads the old tensors, so the wrapper steps eagerly again instead of replaying.
    eager, wrapped, ea, ga = _pair(8, 1)
    for step in range(6):
        if step >= 3:
            for q in ga:
                q.grad = None
            for q, g in zip(ga, _grads(step, ga)):
                q.grad = g.clone()
            for p, g in zip(ea, _grads(step, ea)):
                p.grad = g.clone()
        else:
            _same_grads(step, ea, ga)
        eager.step()
        wrapped.step()
        assert all(torch.equal(p, q) for p, q in zip(ea, ga)), step
    wrapped.release()


def test_replays_are_counted_when_a_step_that_does_not_wait_raises_for_none():
    # blocking=False under on_nonfinite="raise": the eager step after replays (here one that
    # re-plans for a weight moved to other storage) counts the replays before the engine is rebuilt.
    eager, wrapped, ea, ga = _pair(9, 1, blocking=False)
    for step in range(7):
        _same_grads(step, ea, ga)
        if step == 4:
            ea[0].data = ea[0].data.clone()
            ga[0].data = ga[0].data.clone()
        eager.step()
        wrapped.step()
    assert all(torch.equal(p, q) for p, q in zip(ea, ga))
    assert _steps_of(wrapped, len(ga)) == _steps_of(eager, len(ea)) == [7] * len(ea)
    wrapped.release()


def test_new_gradient_tensors_over_the_same_memory_are_replayed():
    # A bucketed trainer hands each parameter a new view of one flat buffer every step: the graph
    # reads the same memory, so it keeps replaying.
    eager, wrapped, ea, ga = _pair(10, 1)
    flat = torch.zeros(sum(p.numel() for p in ga), device="cuda", dtype=torch.bfloat16)
    for step in range(5):
        offset = 0
        for q, g in zip(ga, _grads(step, ga)):
            view = flat[offset:offset + q.numel()].view_as(q)
            view.copy_(g)
            q.grad = view  # a new tensor each step
            offset += q.numel()
        for p, g in zip(ea, _grads(step, ea)):
            p.grad = g.clone()
        eager.step()
        wrapped.step()
        assert wrapped.captured == (step >= 1), step
        assert all(torch.equal(p, q) for p, q in zip(ea, ga)), step
    wrapped.release()
