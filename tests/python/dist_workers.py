# dist_workers.py — the bodies of the multi-process tests (test_distributed.py), run in every rank
# of a gloo process group on the CPU. Each compares the distributed run with the same rules
# computed in one process: the single-process dion3 optimizer (DDP: equal bit for bit) or the
# float64 transcription of algorithm.md §3 (reference.py with ranks=P: per-shard selection and NorMuon
# rescale). Not collected by pytest (no test_ prefix).
from __future__ import annotations

import copy
import gc
import os
import pickle
import traceback
import warnings
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import dion3
from reference import Reference

# Several matrices per megabatch (3 is not a multiple of 2 or 4), a tall one, uneven shards (10
# rows) and one that leaves a rank empty on 4 ranks (3 rows).
SHAPES = [(24, 40), (24, 40), (24, 40), (48, 20), (10, 16), (3, 12)]
RTOL = 2e-5


def run(rank, world, tmp, name, args):
    """Entry point of a spawned rank: init gloo, run the named check, report failures in a file."""
    import faulthandler

    # A crash (not an exception) leaves its stack here for the parent to show.
    fault = open(os.path.join(tmp, f"fault.{rank}"), "w")
    faulthandler.enable(file=fault)
    try:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), world), rank=rank,
                                world_size=world)
        torch.set_num_threads(1)
        globals()[name](rank, world, tmp, *args)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - everything goes to the parent
        with open(os.path.join(tmp, f"error.{rank}"), "w") as f:
            f.write(traceback.format_exc())
        raise


def close(a, b, what, rtol=RTOL):
    a, b = a.double(), b.double()
    err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
    assert err <= rtol, f"{what}: max relative difference {err:.3g} > {rtol:g}"


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def same_everywhere(rank, world, ps, what):
    """Every weight in ps is the same tensor on every rank (replicas kept in step)."""
    for p in ps:
        mine = full(p.detach()).clone()
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        assert all(torch.equal(every[0], w) for w in every), f"rank {rank}: {what}: the ranks drifted apart"


def grads_for(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


def steps_match_reference(opt, ref, ps, shapes, seed, place, what, steps=3, absent=None):
    """Steps `opt` and the single-process float64 `ref` on the same full gradients (each placed on
    its parameter by place(g, p)); every parameter equals the reference after every step.
    absent(step, i): parameter i has no gradient at that step."""
    for step in range(steps):
        gs = grads_for(shapes, seed + step)
        if absent is not None:
            gs = [None if absent(step, i) else g for i, g in enumerate(gs)]
        for p, g in zip(ps, gs):
            p.grad = None if g is None else place(g, p)
        opt.step()
        ref.step(gs)
        for i, (p, w) in enumerate(zip(ps, ref.w)):
            close(full(p.detach()), w, f"{what} parameter {i} {tuple(w.shape)} at step {step}")


# ---- layouts --------------------------------------------------------------------------------

def refused(rank, opt, ps, expect):
    """opt.step() raises a ValueError naming `expect` on this rank, and no weight moved."""
    before = [full(p.detach()).clone() for p in ps]
    try:
        opt.step()
        raise AssertionError(f"rank {rank}: a step expected to be refused was applied")
    except ValueError as e:
        assert expect in str(e), f"rank {rank}: {e}"
    assert all(torch.equal(full(p.detach()), b) for p, b in zip(ps, before)), \
        f"rank {rank}: a refused step moved weights"


def ddp(rank, world, opt_cls, transposed=False, **kw):
    """DDP (replicated parameters, distributed_mesh = ProcessGroup) equals the single-process run;
    transposed: SHAPES stored (in, out) in a transposed group."""
    torch.manual_seed(0)
    ws = [nn.Parameter(torch.randn(s) * 0.05) for s in SHAPES]
    single = [nn.Parameter(w.detach().clone()) for w in ws]
    opt = opt_cls([dict(params=ws, transposed=True)] if transposed else ws, distributed_mesh=dist.group.WORLD, **kw)
    ref = opt_cls([dict(params=single, transposed=True)] if transposed else single, **kw)
    what = f"DDP {opt_cls.__name__}{' transposed' if transposed else ''}"
    for step in range(3):
        for w, s, g in zip(ws, single, grads_for(SHAPES, step)):
            w.grad, s.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        for i, (w, s) in enumerate(zip(ws, single)):
            assert torch.equal(w, s), f"{what}: parameter {i} differs from one process at step {step}"
    plan = opt.plan()
    assert all(mb["layout"] == "replicated" and mb["ranks"] == world for mb in plan), plan
    if transposed:  # Dion3 and NorMuon step every matrix by columns (its output features)
        assert all(mb["columns"] == (opt_cls is not dion3.Muon) for mb in plan), plan
    else:
        assert any(mb["columns"] for mb in plan) == (opt_cls is dion3.Dion2), plan  # SHAPES holds a tall matrix
    # A deep copy steps over the same process group, as the original does; pickling says why not.
    ws2, opt2 = copy.deepcopy((ws, opt))
    assert opt2._mesh is dist.group.WORLD
    for step in range(3, 5):
        for w, w2, g in zip(ws, ws2, grads_for(SHAPES, step)):
            w.grad, w2.grad = g.clone(), g.clone()
        opt.step()
        opt2.step()
        assert all(torch.equal(w, w2) for w, w2 in zip(ws, ws2)), f"DDP {opt_cls.__name__}: a deep copy differs"
    try:
        pickle.dumps(opt)
    except TypeError as e:
        assert "over a ProcessGroup cannot be pickled" in str(e), e
    else:
        raise AssertionError("an optimizer over a ProcessGroup was pickled")
    assert copy.copy(opt)._mesh is dist.group.WORLD  # a shallow copy is no pickle


def destroyed_group(rank, world):
    """A process group given as distributed_mesh is freed when the user destroys it, though the
    optimizer lives on (neither it nor its engine holds the group: one left to the interpreter's
    teardown can abort a gloo process), and a step on it after that says what happened."""
    sub = dist.new_group(list(range(world)))
    ws = [nn.Parameter(torch.zeros(s)) for s in SHAPES[:2]]
    opt = dion3.Dion3(ws, distributed_mesh=sub, lr=0.02)
    for w, g in zip(ws, grads_for(SHAPES[:2], 0)):
        w.grad = g
    opt.step()
    held = weakref.ref(sub)
    dist.destroy_process_group(sub)
    del sub
    gc.collect()
    assert held() is None, "the optimizer still holds the process group it was given after its destruction"
    try:
        opt.step()
    except ValueError as e:
        assert "destroyed" in str(e), e
    else:
        raise AssertionError("a step on a destroyed process group was not refused")


def sharded_params(mesh, placements, seed=0, shapes=None):
    g = torch.Generator().manual_seed(seed)
    fulls = [torch.randn(s, generator=g) * 0.05 for s in shapes or SHAPES]
    return fulls, [nn.Parameter(distribute_tensor(f.clone(), mesh, placements)) for f in fulls]


def fsdp(rank, world, mesh, placements, shard_ranks, opt_cls, algorithm, pass_mesh=None, shapes=None, **kw):
    """Row-sharded DTensors (FSDP2's Shard(0)) equal algorithm.md §3's rule computed in one process;
    column-sharded ones (Shard(1)) the single-device rule (shard_ranks=1)."""
    fulls, ps = sharded_params(mesh, placements, shapes=shapes)
    opt = opt_cls(ps, distributed_mesh=pass_mesh or mesh, lr=0.02, **kw)
    ref = Reference(fulls, algorithm=algorithm, lr=0.02, ranks=shard_ranks, **kw)
    steps_match_reference(opt, ref, ps, shapes or SHAPES, 100, lambda g, p: distribute_tensor(g, mesh, placements),
                          f"{algorithm} {kw}")
    for p in ps:  # state tensors are DTensors placed like their parameter
        assert p._version > 0 and p.to_local()._version > 0, "a step left a DTensor's version as it was"
        st = opt.state[p]
        assert isinstance(st["momentum"], DTensor) and st["momentum"].placements == p.placements
        if algorithm != "dion2":  # no NorMuon there
            assert tuple(st["variance_neuron"].shape) == (p.shape[0], 1)


def torch_muon_sharded(rank, world, mesh):
    """dion3.optim.Muon (torch.optim.Muon's form) on row and column shards equals the same
    optimizer in one process, through a change of its momentum between steps."""
    for placements in ([Shard(0)], [Shard(1)]):
        fulls, ps = sharded_params(mesh, placements)
        single = [nn.Parameter(f.clone()) for f in fulls]
        opt = dion3.optim.Muon(ps, lr=0.02, distributed_mesh=mesh)
        ref = dion3.optim.Muon(single, lr=0.02)
        for step in range(3):
            for o in (opt, ref):
                o.param_groups[0]["momentum"] = 0.9 + 0.02 * step
            for p, s, g in zip(ps, single, grads_for(SHAPES, 200 + step)):
                p.grad, s.grad = distribute_tensor(g, mesh, placements), g.clone()
            opt.step()
            ref.step()
            for i, (p, s) in enumerate(zip(ps, single)):
                close(full(p.detach()), s.detach(), f"dion3.optim.Muon {placements} parameter {i} at step {step}")
        saved = opt.state_dict()["state"][0]["momentum_buffer"]
        close(full(saved), ref.state_dict()["state"][0]["momentum_buffer"], f"dion3.optim.Muon {placements} buffer")


# Column shards: uneven (18 columns), one column (ranks past the first hold none) and, on 4 ranks,
# one rank without columns (3).
COL_SHAPES = [(24, 40), (24, 40), (24, 40), (40, 18), (9, 1), (12, 3)]


def nonfinite(rank, world, mesh):
    """A NaN in one rank's shard: every rank skips (or raises) and nothing moves anywhere."""
    for policy in ("skip", "raise"):
        fulls, ps = sharded_params(mesh, [Shard(0)], seed=5)
        opt = dion3.Dion3(ps, distributed_mesh=mesh, on_nonfinite=policy)
        gs = grads_for(SHAPES, 7)
        for p, g in zip(ps, gs):
            p.grad = distribute_tensor(g, mesh, [Shard(0)])
        if rank == world - 1:
            ps[0].grad.to_local()[0, 0] = float("nan")
        before = [p.to_local().clone() for p in ps]
        if policy == "skip":
            opt.step()
            assert opt.steps_skipped == 1, f"rank {rank}: the step was not skipped"
        else:
            try:
                opt.step()
                raise AssertionError(f"rank {rank}: no NonFiniteError")
            except dion3.NonFiniteError as e:
                assert ("another rank" in str(e)) == (rank != world - 1), str(e)
        for p, b in zip(ps, before):
            assert torch.equal(p.to_local(), b), f"rank {rank} moved its shard ({policy})"
        assert all(not opt.state[p]["momentum"].to_local().any() for p in ps)


def state_written_in_place(rank, world, mesh):
    """A DTensor momentum written in place (its own version moves, not its local tensor's): the
    next check reads it whole and drops the step that would overflow it, on every rank."""
    big = torch.finfo(torch.float32).max
    for write in (lambda m: m.fill_(0.9 * big), lambda m: m.copy_(torch.full_like(m, 0.9 * big))):
        fulls, ps = sharded_params(mesh, [Shard(0)], seed=5)
        opt = dion3.Dion3(ps, distributed_mesh=mesh, on_nonfinite="skip")
        for _ in range(2):
            for p in ps:
                p.grad = distribute_tensor(torch.full(p.shape, 0.5), mesh, [Shard(0)])
            opt.step()
        with torch.no_grad():
            write(opt.state[ps[0]]["momentum"])
        for p in ps:
            p.grad = distribute_tensor(torch.full(p.shape, 0.2 * big), mesh, [Shard(0)])
        before = [p.to_local().clone() for p in ps]
        opt.step()
        assert opt.steps_skipped == 1, f"rank {rank}: the step over the written momentum was applied"
        for p, b in zip(ps, before):
            assert torch.equal(p.to_local(), b), f"rank {rank} moved its shard"


def replay_gradients_compared(rank, world, mesh):
    """refresh_hyperparameters() (before a replay) compares DTensor gradients' local memory with
    what the last step bound: new gradient DTensors ask for a new capture, in-place writes do not."""
    fulls, ps = sharded_params(mesh, [Shard(0)], seed=6)
    opt = dion3.Dion3(ps, distributed_mesh=mesh)
    for p in ps:
        p.grad = distribute_tensor(torch.randn(p.shape), mesh, [Shard(0)])
    opt.step()
    opt.refresh_hyperparameters()
    ps[0].grad.mul_(2.0)
    opt.refresh_hyperparameters()
    ps[1].grad = distribute_tensor(torch.randn(ps[1].shape), mesh, [Shard(0)])
    try:
        opt.refresh_hyperparameters()
        raise AssertionError(f"rank {rank}: a new gradient DTensor was not noticed before a replay")
    except RuntimeError as e:
        assert "capture again" in str(e), str(e)
    opt.step()
    opt.refresh_hyperparameters()


def refusals(rank, world, mesh):
    """Bad layouts, and a deferred non-finite raise, are refused on every rank, before anything
    is written."""
    p = nn.Parameter(distribute_tensor(torch.randn(2, 8, 6), mesh, [Shard(2)]))
    try:
        dion3.Dion3([p], distributed_mesh=mesh, flatten=True)
        raise AssertionError("Shard(2) accepted")
    except NotImplementedError as e:
        assert "Shard(2)" in str(e), str(e)
    c = nn.Parameter(distribute_tensor(torch.randn(8, 6), mesh, [Shard(1)]))
    c.grad = distribute_tensor(torch.randn(8, 6), mesh, [Shard(1)])
    try:
        dion3.Dion2([c], distributed_mesh=mesh).step()
        raise AssertionError("Dion2 on column shards accepted")
    except ValueError as e:
        assert "dion2 is not available where the columns are sharded" in str(e), str(e)
    q = nn.Parameter(distribute_tensor(torch.randn(8, 6), mesh, [Shard(0)]))
    try:
        dion3.Dion3([q])  # no mesh for a DTensor
        raise AssertionError("a DTensor without distributed_mesh accepted")
    except ValueError as e:
        assert "distributed_mesh" in str(e), str(e)
    try:
        dion3.Dion3([q], distributed_mesh=dist.group.WORLD)
        raise AssertionError("a DTensor with a ProcessGroup accepted")
    except ValueError as e:
        assert "DeviceMesh" in str(e), str(e)
    try:  # each rank would learn of a dropped step at its own time
        dion3.Dion3([q], distributed_mesh=mesh, on_nonfinite="raise", blocking=False)
        raise AssertionError("a deferred raise accepted under a mesh")
    except ValueError as e:
        assert "cannot be distributed" in str(e), str(e)
    two = [q, nn.Parameter(distribute_tensor(torch.randn(8, 6), init_device_mesh("cpu", (world,)), [Shard(0)]))]
    if world >= 4:
        other = init_device_mesh("cpu", (2, world // 2))
        two[1] = nn.Parameter(distribute_tensor(torch.randn(8, 6), other, [Replicate(), Shard(0)]))
        try:
            dion3.Dion3(two, distributed_mesh=mesh)
            raise AssertionError("parameters on two meshes in one group accepted")
        except ValueError as e:
            assert "lives on" in str(e) or "different device meshes" in str(e), str(e)
        r = nn.Parameter(distribute_tensor(torch.randn(8, 6), other, [Replicate(), Shard(0)]))
        try:
            dion3.Dion3([r], distributed_mesh=mesh)
            raise AssertionError("a parameter on another mesh accepted")
        except ValueError as e:
            assert "lives on" in str(e), str(e)


def agreement(rank, world, mesh):
    """Ranks that disagree about the step refuse it together, every time, and nothing moves:
    ranks that would plan different steps (one lacks a gradient), and a rank with no gradient at
    all after earlier steps (it joins the others' first collective to refuse). Afterwards the
    ranks step together again."""
    torch.manual_seed(0)
    ps = [nn.Parameter(torch.randn(8, 6)) for _ in range(3)]
    opt = dion3.Dion3(ps, distributed_mesh=dist.group.WORLD, lr=0.05)
    before = [p.detach().clone() for p in ps]
    for attempt in range(2):  # the refusal is not remembered as a valid plan: it comes again
        for i, p in enumerate(ps):
            p.grad = None if (rank == world - 1 and i == 2) else torch.ones(8, 6)
        try:
            opt.step()
            raise AssertionError(f"rank {rank}: attempt {attempt} with different plans stepped")
        except ValueError as e:
            assert "planned different steps" in str(e), str(e)
    assert all(torch.equal(p, b) for p, b in zip(ps, before)), f"rank {rank}: a refused step moved weights"
    for p in ps:
        p.grad = torch.ones(8, 6)
    opt.step()
    for p in ps:
        p.grad = None if rank == world - 1 else torch.full((8, 6), 2.0)
    mine = "no parameter of this rank has a gradient"
    refused(rank, opt, ps, mine if rank == world - 1 else "another rank took no part")
    for p in ps:
        p.grad = torch.full((8, 6), 3.0)
    opt.step()
    same_everywhere(rank, world, ps, "after a rank without gradients refused")
    # A second moment written with a NaN on one rank alone (there also planned anew, the second
    # time): every rank refuses the step, the bad one naming it, and nothing moves.
    for rebuild in (False, True):
        torch.manual_seed(1)
        qs = [nn.Parameter(torch.randn(8, 6)) for _ in range(2)]
        opt = dion3.Dion3(qs, distributed_mesh=dist.group.WORLD, lr=0.05)
        for q in qs:
            q.grad = torch.ones(8, 6)
        opt.step()
        if rank == world - 1:
            opt.state[qs[0]]["variance_neuron"][0, 0] = float("nan")
            if rebuild:
                qs[1].data = qs[1].data.clone()
        mine = "written since the last step"
        refused(rank, opt, qs, mine if rank == world - 1 else "another rank refused this step")
    # Same-shape matrices listed in another order on one rank (named, as a model names them):
    # their updates would be swapped there; every rank refuses instead.
    named = [("a", nn.Parameter(torch.ones(8, 6))), ("b", nn.Parameter(torch.ones(8, 6)))]
    if rank == world - 1:
        named.reverse()
    swapped = dion3.Dion3([dict(params=[p for _, p in named], param_names=[n for n, _ in named])],
                          distributed_mesh=dist.group.WORLD, lr=0.05)
    for _, p in named:
        p.grad = torch.ones(8, 6)
    try:
        swapped.step()
        raise AssertionError(f"rank {rank}: parameters listed in another order on one rank stepped")
    except ValueError as e:
        assert "the parameters' names, in order" in str(e), str(e)


def one_rank_changes(rank, world, mesh):
    """A change made on one rank alone that makes it plan anew: its first collective is the same
    agreement the others make. Weights or state given new storage there (the same plan) step on
    every rank, equal to one process; a setting that changes the plan there is refused by every
    rank at once, nothing moved, instead of a hang; made alike again, the ranks step together."""
    for fsdp_layout in (False, True):
        torch.manual_seed(0)
        fulls = [torch.randn(s) * 0.05 for s in SHAPES]
        single = [nn.Parameter(f.clone()) for f in fulls]
        if fsdp_layout:
            ps = [nn.Parameter(distribute_tensor(f.clone(), mesh, [Shard(0)])) for f in fulls]
            opt = dion3.Dion3(ps, distributed_mesh=mesh, lr=0.02)
            ref = Reference(fulls, algorithm="dion3", lr=0.02, ranks=world)
        else:
            ps = [nn.Parameter(f.clone()) for f in fulls]
            opt = dion3.Dion3(ps, distributed_mesh=dist.group.WORLD, lr=0.02)
            ref = dion3.Dion3(single, lr=0.02)
        what = "FSDP2" if fsdp_layout else "DDP"

        def step(seed, expect_refusal=False):
            gs = grads_for(SHAPES, seed)
            for p, s, g in zip(ps, single, gs):
                p.grad = distribute_tensor(g, mesh, [Shard(0)]) if fsdp_layout else g.clone()
                s.grad = g.clone()
            if expect_refusal:
                refused(rank, opt, ps, "planned different steps")
                return
            opt.step()
            if fsdp_layout:
                ref.step(gs)
                for i, (p, w) in enumerate(zip(ps, ref.w)):
                    close(full(p.detach()), w, f"rank {rank} {what} parameter {i} at step {seed}")
            else:
                ref.step()
                for i, (p, s) in enumerate(zip(ps, single)):
                    assert torch.equal(p, s), f"rank {rank} {what}: parameter {i} differs from one process at step {seed}"

        step(0)
        if rank == 0:  # the weight moved to other storage on this rank only
            ps[0].data = ps[0].data.clone()
        step(1)
        if rank == world - 1:  # a state tensor moved on this rank only
            st = opt.state[ps[1]]["momentum"]
            st.data = st.data.clone()
        step(2)
        if rank == 0:
            opt.param_groups[0]["fraction"] = 0.5
        step(3, expect_refusal=True)
        if rank == 0:
            opt.param_groups[0]["fraction"] = 0.25
        step(4)


def one_rank_settings(rank, world, mesh):
    """Settings that change a plan's collectives or results but no shape, changed on one rank
    alone (selection_scope under FSDP2, cautious_wd, an element-wise group's algorithm,
    hyper-parameters), or that are invalid there alone: every rank refuses the step, nothing
    moved; alike again, the ranks step together. And a rank
    without gradients right after load_state_dict (which drops the engine) refuses with the
    others instead of stepping alone."""
    torch.manual_seed(0)

    # FSDP2 row shards, every row selected (the same k and pieces under either scope).
    fulls = [torch.randn(s) * 0.05 for s in SHAPES[:3]]
    ps = [nn.Parameter(distribute_tensor(f.clone(), mesh, [Shard(0)])) for f in fulls]
    opt = dion3.Dion3(ps, distributed_mesh=mesh, lr=0.02, fraction=1.0)

    def grads(seed):
        for p, g in zip(ps, grads_for(SHAPES[:3], seed)):
            p.grad = distribute_tensor(g, mesh, [Shard(0)])

    grads(0)
    opt.step()
    for key, changed, alike in (("selection_scope", "global", "local"), ("cautious_wd", True, False)):
        if rank == 0:
            opt.param_groups[0][key] = changed
        grads(1)
        refused(rank, opt, ps, "planned different steps")
        if rank == 0:
            opt.param_groups[0][key] = alike
        grads(2)
        opt.step()
        same_everywhere(rank, world, ps, f"FSDP2 after {key}")

    # DDP with an element-wise group.
    w, b = nn.Parameter(torch.randn(8, 6) * 0.05), nn.Parameter(torch.zeros(6))
    opt = dion3.Dion3([{"params": [w]}, {"params": [b], "algorithm": "adamw"}], distributed_mesh=dist.group.WORLD,
                      lr=0.02)

    def grads2(seed):
        g = torch.Generator().manual_seed(seed)
        w.grad, b.grad = torch.randn(8, 6, generator=g), torch.randn(6, generator=g)

    grads2(0)
    opt.step()
    if rank == 0:
        opt.param_groups[1]["algorithm"] = "lion"
    grads2(1)
    refused(rank, opt, [w, b], "planned different steps")
    if rank == 0:
        opt.param_groups[1]["algorithm"] = "adamw"
    grads2(2)
    opt.step()
    same_everywhere(rank, world, [w, b], "DDP after an element-wise algorithm")
    # A replicated vector of another length on one rank alone would step other elements there.
    w2, b2 = nn.Parameter(torch.randn(8, 6) * 0.05), nn.Parameter(torch.zeros(7 if rank == 0 else 6))
    opt2 = dion3.Dion3([{"params": [w2]}, {"params": [b2], "algorithm": "adamw"}], distributed_mesh=dist.group.WORLD,
                       lr=0.02)
    w2.grad, b2.grad = torch.ones(8, 6), torch.ones_like(b2)
    refused(rank, opt2, [w2, b2], "planned different steps")
    # Hyper-parameters that differ on one rank alone would part the replicas: refused by every rank.
    seed = 10
    for gi, key, value in ((0, "lr", 0.03), (1, "weight_decay", 0.5), (1, "betas", (0.8, 0.95))):
        kept = opt.param_groups[gi][key]
        if rank == 0:
            opt.param_groups[gi][key] = value
        grads2(seed)
        refused(rank, opt, [w, b], "stepped with different hyper-parameters")
        opt.param_groups[gi][key] = kept
        grads2(seed + 1)
        opt.step()
        same_everywhere(rank, world, [w, b], f"DDP after {key} on one rank")
        seed += 2
    # A setting invalid on one rank alone (an lr or betas the front end refuses, num_heads the
    # planner refuses), or a gradient refused there: that rank raises its own error, and the others
    # raise with it instead of waiting for it.
    for gi, key, value, own in ((0, "lr", float("nan"), "lr"), (1, "betas", (0.9,), "betas"),
                                (0, "num_heads", 5, "num_heads"), (0, "grad", "sparse", "sparse")):
        kept = None if key == "grad" else opt.param_groups[gi][key]
        grads2(seed)
        if rank == 0:
            if key == "grad":
                w.grad = w.grad.to_sparse()
            else:
                opt.param_groups[gi][key] = value
        refused(rank, opt, [w, b], own if rank == 0 else "another rank refused this step")
        if key != "grad":
            opt.param_groups[gi][key] = kept
        grads2(seed + 1)
        opt.step()
        same_everywhere(rank, world, [w, b], f"DDP after an invalid {key} on one rank")
        seed += 2
    # load_state_dict everywhere, then no gradients on the last rank.
    opt.load_state_dict(opt.state_dict())
    grads2(3)
    if rank == world - 1:
        w.grad = b.grad = None
    expect = "no parameter of this rank has a gradient" if rank == world - 1 else "another rank took no part"
    refused(rank, opt, [w, b], expect)
    grads2(4)
    opt.step()
    same_everywhere(rank, world, [w, b], "DDP after a refusal right after load_state_dict")
    # No gradients on the last rank at the very first step (no engine yet): refused as well, with
    # the plan the others make (a frozen parameter in the group is not part of it).
    w0 = nn.Parameter(torch.randn(8, 6) * 0.05)
    frozen = nn.Parameter(torch.randn(4, 4), requires_grad=False)
    opt = dion3.Dion3([w0, frozen], distributed_mesh=dist.group.WORLD, lr=0.02)
    w0.grad = None if rank == world - 1 else torch.ones(8, 6)
    refused(rank, opt, [w0], expect)
    assert "momentum" not in opt.state[w0] or not opt.state[w0]["momentum"].any(), f"rank {rank}: state moved"
    w0.grad = torch.ones(8, 6)
    opt.step()
    same_everywhere(rank, world, [w0], "DDP after a refusal at the first step")
    # A group added on every rank makes the next step plan anew; an lr invalid there on one rank
    # is still refused by all (with the plan the engine held before).
    extra = nn.Parameter(torch.zeros(5))
    opt.add_param_group({"params": [extra], "algorithm": "lion"})
    if rank == 0:
        opt.param_groups[0]["lr"] = float("nan")
    w0.grad, extra.grad = torch.ones(8, 6), torch.ones(5)
    refused(rank, opt, [w0, extra], "lr" if rank == 0 else "another rank refused this step")
    opt.param_groups[0]["lr"] = 0.02
    opt.step()
    same_everywhere(rank, world, [w0, extra], "DDP after a refusal as a group was added")
    # No plan to refuse through yet (the first step, the first after load_state_dict): the ranks
    # check their groups together first.
    for when in ("first step", "first step after a load"):
        w1 = nn.Parameter(torch.randn(8, 6) * 0.05)
        opt = dion3.Dion3([w1], distributed_mesh=dist.group.WORLD, lr=0.02)
        if when != "first step":
            w1.grad = torch.ones(8, 6)
            opt.step()
            opt.load_state_dict(opt.state_dict())
        if rank == 0:
            opt.param_groups[0]["lr"] = float("nan")
        w1.grad = torch.ones(8, 6)
        refused(rank, opt, [w1], "lr" if rank == 0 else "another rank refused this step")
        opt.param_groups[0]["lr"] = 0.02
        opt.step()
        same_everywhere(rank, world, [w1], f"DDP after a refusal at the {when}")
    # Refused while registering on one rank alone (two parameters tied there; a state tensor given
    # storage of another shape there), with no plan yet or with the one the others step with:
    # every rank raises at once, and the next steps pair up as before.
    for when in ("first step", "first step after a load", "step that plans anew"):
        pair = [nn.Parameter(torch.randn(8, 6) * 0.05) for _ in range(2)]
        opt = dion3.Dion3(pair, distributed_mesh=dist.group.WORLD, lr=0.02)
        if when != "first step":
            for p in pair:
                p.grad = torch.ones(8, 6)
            opt.step()
            if when == "first step after a load":
                opt.load_state_dict(opt.state_dict())
        for p in pair:
            p.grad = torch.ones(8, 6)
        kept = pair[1].data
        if rank == 0 and when != "step that plans anew":
            pair[1].data = pair[0].data
        own = "shares memory"
        if rank == 0 and when == "step that plans anew":
            kept = opt.state[pair[0]]["momentum"].data
            opt.state[pair[0]]["momentum"].data = torch.zeros(8, 7)
            own = "its state 'momentum' has shape [8, 7]"
        refused(rank, opt, pair, own if rank == 0 else "another rank refused this step")
        if rank == 0:
            if when == "step that plans anew":
                opt.state[pair[0]]["momentum"].data = kept
            else:
                pair[1].data = kept
        for p in pair:
            p.grad = torch.ones(8, 6)
        opt.step()
        same_everywhere(rank, world, pair, f"DDP after a refusal while registering at the {when}")
    # Refused while registering on a rank without a plan to refuse through: the same refusal again
    # at the next step (the plan kept), after a step no rank had gradients for, and on a rank that
    # has no gradients at the first step (its registration is tried with the others' agreement).
    for when in ("twice in a row", "after a step without gradients", "without gradients at the first step"):
        pair = [nn.Parameter(torch.randn(8, 6) * 0.05) for _ in range(2)]
        opt = dion3.Dion3(pair, distributed_mesh=dist.group.WORLD, lr=0.02)
        if when == "twice in a row":
            for p in pair:
                p.grad = torch.ones(8, 6)
            opt.step()
        elif when == "after a step without gradients":
            opt.step()  # no rank has gradients: nothing to do anywhere
        kept = pair[1].data
        if rank == 0:
            pair[1].data = pair[0].data
        for attempt in range(2 if when == "twice in a row" else 1):
            for p in pair:
                p.grad = None if rank == 0 and when.startswith("without") else torch.ones(8, 6)
            refused(rank, opt, pair, "shares memory" if rank == 0 else "another rank refused this step")
        if rank == 0:
            pair[1].data = kept
        for p in pair:
            p.grad = torch.ones(8, 6)
        opt.step()
        same_everywhere(rank, world, pair, f"DDP after a refusal while registering {when}")
    # Refused because one rank had no gradients, then a step no rank has gradients for (one rank
    # holds an engine, the other none): both take the same path, and the next step pairs up.
    w4 = nn.Parameter(torch.randn(8, 6) * 0.05)
    opt = dion3.Dion3([w4], distributed_mesh=dist.group.WORLD, lr=0.02)
    w4.grad = torch.ones(8, 6) if rank == 0 else None
    refused(rank, opt, [w4], "another rank took no part" if rank == 0 else "no parameter of this rank has a gradient")
    w4.grad = None
    opt.step()
    for seed in (5, 6):
        w4.grad = torch.full((8, 6), float(seed))
        opt.step()
    same_everywhere(rank, world, [w4], "DDP after steps some or all ranks had no gradients for")
    # A switch of algorithm at the first step after a load, refused by one rank: the others put the
    # replaced state back, so switching back leaves every rank's state alike.
    w3, b3 = nn.Parameter(torch.randn(8, 6) * 0.05), nn.Parameter(torch.zeros(6))
    other = nn.Parameter(torch.randn(8, 6) * 0.05)
    opt = dion3.Dion3([{"params": [w3, other]}, {"params": [b3], "algorithm": "adamw"}],
                      distributed_mesh=dist.group.WORLD, lr=0.02)

    def grads3(seed):
        g = torch.Generator().manual_seed(seed)
        w3.grad, other.grad, b3.grad = (torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g),
                                        torch.randn(6, generator=g))

    for seed in (0, 1):
        grads3(seed)
        opt.step()
    opt.load_state_dict(opt.state_dict())
    opt.param_groups[1]["algorithm"] = "lion"
    kept = other.data
    if rank == 0:
        other.data = w3.data
    grads3(2)
    refused(rank, opt, [w3, b3], "shares memory" if rank == 0 else "another rank refused this step")
    if rank == 0:
        other.data = kept
    opt.param_groups[1]["algorithm"] = "adamw"
    for seed in (3, 4):
        grads3(seed)
        opt.step()
    same_everywhere(rank, world, [w3, other, b3], "DDP after a switch refused at the first step after a load")


def absent_gradients(rank, world, mesh):
    """Matrices without a gradient at some steps (on every rank alike) are left alone and the
    others step as the reference without them, on row and column shards (DTensor gradients) and
    replicated (DDP), all in the plan of the first step."""
    def gone(step, i):
        return step > 0 and (i + step) % 3 == 0

    def builds(opt):  # counts the engines the optimizer makes
        made, rebuild = [], opt._rebuild
        opt._rebuild = lambda *a, **k: (made.append(1), rebuild(*a, **k))[1]
        return made

    for placements, ranks, shapes in (([Shard(0)], world, SHAPES), ([Shard(1)], 1, COL_SHAPES)):
        fulls, ps = sharded_params(mesh, placements, shapes=shapes)
        opt = dion3.Dion3(ps, distributed_mesh=mesh, lr=0.02)
        made = builds(opt)
        ref = Reference(fulls, algorithm="dion3", lr=0.02, ranks=ranks)
        steps_match_reference(opt, ref, ps, shapes, 300, lambda g, p: distribute_tensor(g, mesh, placements),
                              f"without some gradients, {placements}", steps=5, absent=gone)
        assert len(made) == 1, f"rank {rank}: {len(made)} engines for {placements}"
        assert [opt.state[p]["step"] for p in ps] == [5 - sum(gone(s, i) for s in range(5)) for i in range(len(ps))]
    torch.manual_seed(0)
    ws = [nn.Parameter(torch.randn(s) * 0.05) for s in SHAPES]
    single = [nn.Parameter(w.detach().clone()) for w in ws]
    opt, ref = dion3.NorMuon(ws, distributed_mesh=dist.group.WORLD), dion3.NorMuon(single)
    made = builds(opt)
    for step in range(5):
        for i, (w, s, g) in enumerate(zip(ws, single, grads_for(SHAPES, 400 + step))):
            w.grad, s.grad = (None, None) if gone(step, i) else (g.clone(), g.clone())
        opt.step()
        ref.step()
        for i, (w, s) in enumerate(zip(ws, single)):
            assert torch.equal(w, s), f"DDP without some gradients: parameter {i} differs from one process, step {step}"
    assert len(made) == 1, f"rank {rank}: {len(made)} engines under DDP"
    # Steps refused because one rank alone lacks a gradient (a matrix at the first step, or an AdamW
    # vector, which that rank then plans without) do not keep refusing the steps the ranks agree on.
    for lacking in ("matrix", "vector"):
        torch.manual_seed(1)
        ws = [nn.Parameter(torch.randn(8, 6) * 0.05) for _ in range(3)]
        b = nn.Parameter(torch.zeros(6))
        opt = dion3.Dion3([dict(params=ws), dict(params=[b], algorithm="adamw")], distributed_mesh=dist.group.WORLD)
        for step, missing in enumerate(([], ["one rank"], [1], [0, 2], [])):
            if lacking == "matrix" and step == 0:
                missing = ["one rank"]
            one = missing == ["one rank"] and rank == world - 1
            for i, w in enumerate(ws):
                w.grad = None if i in missing or (one and lacking == "matrix" and i == 1) else torch.ones(8, 6)
            b.grad = None if one and lacking == "vector" else torch.ones(6)
            before = [w.detach().clone() for w in ws + [b]]
            try:
                opt.step()
                assert missing != ["one rank"], f"rank {rank}: {lacking} lacking on one rank, step {step} applied"
            except ValueError as e:
                assert missing == ["one rank"], f"rank {rank}: {lacking}, step {step} the ranks agree on: {e}"
                assert all(torch.equal(w, x) for w, x in zip(ws + [b], before)), f"rank {rank}: a refused step moved"
            same_everywhere(rank, world, ws + [b], f"step {step}")


def never_a_gradient(rank, world, mesh):
    """An optimizer whose parameters never get a gradient (built before fully_shard replaced them)
    says so once, on every rank, though each refusal registers them with stand-in gradients."""
    import warnings

    w = nn.Parameter(torch.zeros(8, 6))
    opt = dion3.Dion3([w], distributed_mesh=dist.group.WORLD)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):
            opt.step()
    said = [x for x in caught if "no parameter of this optimizer has had a gradient" in str(x.message)]
    assert len(said) == 1, f"rank {rank}: {[str(x.message) for x in caught]}"


def expert_stacks(rank, world, mesh):
    """A stack of expert matrices (flatten=False) sharded on its expert dimension (FSDP2's
    Shard(0)) is stepped by each rank on its whole experts with the single-device rule: the same
    as one process, also with more ranks than experts, and stored (in, out) in a transposed group;
    sharded inside its matrices, refused."""
    for opt_cls, transposed in ((dion3.Dion3, False), (dion3.NorMuon, False), (dion3.Dion3, True)):
        for experts in (2 * world + 1, world - 1):
            torch.manual_seed(experts)
            whole = torch.randn(experts, 12, 8) * 0.05
            w = nn.Parameter(distribute_tensor(whole.clone(), mesh, [Shard(0)]))
            s = nn.Parameter(whole.clone())
            opt = opt_cls([dict(params=[w], flatten=False, transposed=transposed)], distributed_mesh=mesh, lr=0.02)
            ref = opt_cls([dict(params=[s], flatten=False, transposed=transposed)], lr=0.02)
            for step in range(3):
                g = torch.randn(experts, 12, 8, generator=torch.Generator().manual_seed(step))
                w.grad, s.grad = distribute_tensor(g, mesh, [Shard(0)]), g.clone()
                opt.step()
                ref.step()
                close(full(w.detach()), s.detach(),
                      f"{opt_cls.__name__}{' transposed' if transposed else ''}: {experts} experts sharded, step {step}")
            assert all(mb["layout"] == "local" for mb in opt.plan()), opt.plan()
    w = nn.Parameter(distribute_tensor(torch.randn(4, 12, 8), mesh, [Shard(1)]))
    w.grad = distribute_tensor(torch.randn(4, 12, 8), mesh, [Shard(1)])
    try:
        dion3.Dion3([dict(params=[w], flatten=False)], distributed_mesh=mesh).step()
        raise AssertionError("a stack sharded inside its matrices was stepped")
    except NotImplementedError as e:
        assert "sharded inside its matrices (Shard(1))" in str(e) and "a different update" in str(e), str(e)


def transposed_layouts(rank, world, mesh):
    """Weights stored (in, out) (transposed=True): under DDP equal to one process bit for bit (Dion3
    and NorMuon step them by columns on every rank); cut along their stored rows by FSDP2 (the
    rule's columns) equal to one process, also cut into heads of output features (expert stacks:
    expert_stacks); cut along their stored
    columns, refused on every rank, nothing moved; param_groups gives a Conv1D
    weight under fully_shard a transposed group, and leaves one cut by tensor parallelism as
    stored, with a warning."""
    from torch.distributed.fsdp import fully_shard

    for opt_cls in (dion3.Dion3, dion3.NorMuon, dion3.Muon):
        ddp(rank, world, opt_cls, transposed=True, lr=0.02)
    # (in, out); 3 rows leave ranks empty, 1 row all but one (its variance is replicated all the same)
    shapes = [(40, 24), (40, 24), (40, 24), (16, 48), (16, 48), (3, 12), (1, 12)]
    for opt_cls in (dion3.Dion3, dion3.NorMuon):
        # num_heads: blocks of output features, stored columns (12, 24 and 48 of them)
        for kw, blocks in ((dict(), {}), (dict(fraction=0.5), {}), (dict(), dict(num_heads=4))):
            torch.manual_seed(2)
            whole = [torch.randn(s) * 0.05 for s in shapes]
            ws = [nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)])) for w in whole]
            single = [nn.Parameter(w.clone()) for w in whole]
            opt = opt_cls([dict(params=ws, transposed=True, **blocks)], distributed_mesh=mesh, lr=0.02, **kw)
            ref = opt_cls([dict(params=single, transposed=True, **blocks)], lr=0.02, **kw)
            for step in range(3):
                for w, s, g in zip(ws, single, grads_for(shapes, 10 + step)):
                    w.grad, s.grad = distribute_tensor(g, mesh, [Shard(0)]), g.clone()
                opt.step()
                ref.step()
                for i, (w, s) in enumerate(zip(ws, single)):
                    close(full(w.detach()), s.detach(), f"FSDP2 transposed {opt_cls.__name__} {kw} {blocks} "
                                                        f"parameter {i}, step {step}")
            assert all(mb["layout"] == "column-sharded" and mb["columns"] for mb in opt.plan()), opt.plan()
    w = nn.Parameter(distribute_tensor(torch.randn(24, 16) * 0.05, mesh, [Shard(1)]))
    w.grad = distribute_tensor(torch.randn(24, 16), mesh, [Shard(1)])
    refused(rank, dion3.Dion3([dict(params=[w], transposed=True)], distributed_mesh=mesh), [w], "'transposed' group")

    class Conv1D(nn.Module):  # Hugging Face's: x @ W + b, W stored (in, out)
        def __init__(self, nf, nx):
            super().__init__()
            self.nf = nf
            self.weight = nn.Parameter(torch.randn(nx, nf) * 0.05)
            self.bias = nn.Parameter(torch.zeros(nf))

    model = nn.Module()
    model.c_fc, model.c_proj = Conv1D(32, 8), Conv1D(8, 32)
    fully_shard(model.c_fc, mesh=mesh)  # its class becomes FSDPConv1D
    fully_shard(model, mesh=mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        groups = dion3.param_groups(model)
    assert sorted(n for g in groups if g.get("transposed") for n in g["param_names"]) == ["c_fc.weight", "c_proj.weight"]
    model.c_fc.weight = nn.Parameter(distribute_tensor(torch.randn(8, 32), mesh, [Shard(1)]))  # tensor parallel's cut
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        groups = dion3.param_groups(model)
    assert any("1 weights stored (in, out)" in str(c.message) and "c_fc.weight" in str(c.message) for c in caught), \
        [str(c.message) for c in caught]
    assert [n for g in groups if g.get("transposed") for n in g["param_names"]] == ["c_proj.weight"], groups


def partial_gradients(rank, world, mesh):
    """A gradient that autograd left Partial (a replicated weight under sequence or tensor
    parallelism) is summed over the ranks before the step, as torch.optim does: the result is the
    single-process step on the summed gradient, on every rank."""
    from torch.distributed.tensor import Partial

    torch.manual_seed(0)
    w0, b0 = torch.randn(8, 6) * 0.1, torch.randn(6) * 0.1
    w = nn.Parameter(distribute_tensor(w0.clone(), mesh, [Replicate()]))
    b = nn.Parameter(distribute_tensor(b0.clone(), mesh, [Replicate()]))
    opt = dion3.Dion3([dict(params=[w]), dict(params=[b], algorithm="adamw")], distributed_mesh=mesh, lr=0.05)
    sw, sb = nn.Parameter(w0.clone()), nn.Parameter(b0.clone())
    single = dion3.Dion3([dict(params=[sw]), dict(params=[sb], algorithm="adamw")], lr=0.05)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        gw = [torch.randn(8, 6, generator=g) for _ in range(world)]
        gb = [torch.randn(6, generator=g) for _ in range(world)]
        w.grad = DTensor.from_local(gw[rank].clone(), mesh, [Partial()])
        b.grad = DTensor.from_local(gb[rank].clone(), mesh, [Partial()])
        opt.step()
        sw.grad, sb.grad = sum(gw), sum(gb)
        single.step()
    close(w.to_local(), sw.detach(), "a Partial gradient's matrix step")
    close(b.to_local(), sb.detach(), "a Partial gradient's AdamW step")


def one_rank_errors(rank, world, mesh):
    """Errors on one rank alone that are not invalid settings of the engine's: every rank refuses
    and the ranks step together afterwards. An option refused with NotImplementedError there; a
    replicated weight's Partial gradient absent there (its sum over the ranks is a collective the
    rank would not join), at a first step and at a later one; a state_dict malformed there (a
    structure no check foresaw) or with a bad skipped-step count there, which every rank refuses; a
    None state entry there, which is no
    saved state (that rank's parameter starts afresh) rather than a half-made load."""
    from torch.distributed.tensor import Partial

    torch.manual_seed(0)
    last = rank == world - 1
    w = nn.Parameter(torch.randn(8, 6) * 0.1)
    opt = dion3.Dion3([dict(params=[w], param_names=["w"])], distributed_mesh=dist.group.WORLD, lr=0.02)

    def grad(seed):
        w.grad = torch.randn(8, 6, generator=torch.Generator().manual_seed(seed))

    grad(0)
    opt.step()
    if last:
        opt.param_groups[0]["newton_schulz_func"] = lambda x: x
    grad(1)
    before = w.detach().clone()
    try:
        opt.step()
        raise AssertionError(f"rank {rank}: a step expected to be refused was applied")
    except (ValueError, NotImplementedError) as e:
        assert ("newton_schulz_func" if last else "another rank refused") in str(e), f"rank {rank}: {e}"
    assert torch.equal(w.detach(), before)
    opt.param_groups[0].pop("newton_schulz_func", None)
    grad(2)
    opt.step()  # the ranks' collectives still pair

    # Malformed on the last rank alone (a structure no check foresaw), or a bad skipped-step count.
    for spoil, says in ((lambda sd: sd["param_groups"][0].update(param_names=3), "malformed"),
                        (lambda sd: sd.update(steps_skipped=-1), "'steps_skipped' must be a count")):
        sd = copy.deepcopy(opt.state_dict())
        if last:
            spoil(sd)
        try:
            opt.load_state_dict(sd)
            raise AssertionError(f"rank {rank}: a state_dict spoilt on rank {world - 1} was loaded ({says})")
        except ValueError as e:
            assert (says if last else "refused the state_dict") in str(e), f"rank {rank}: {e}"
    sd = copy.deepcopy(opt.state_dict())
    if last:
        sd["state"][0] = None
    opt.load_state_dict(sd)
    assert set(opt.state[w]) >= {"momentum", "step"}

    # Under either on_nonfinite (the CPU blocks at every step, so 'skip' checks as 'raise' does).
    for on_nonfinite in ("raise", "skip"):
        ps = [nn.Parameter(distribute_tensor(torch.randn(8, 6) * 0.1, mesh, [Replicate()])) for _ in range(2)]
        opt = dion3.Dion3(ps, distributed_mesh=mesh, lr=0.02, on_nonfinite=on_nonfinite)
        for step in range(4):  # absent on the last rank at the first step (no engine yet) and at the third
            for p in ps:
                p.grad = DTensor.from_local(torch.full((8, 6), float(rank + 1)), mesh, [Partial()], run_check=False)
            if step not in (0, 2):
                opt.step()
                continue
            if last:
                ps[0].grad = None
            refused(rank, opt, ps, "has a gradient on some ranks and none on others")
        same_everywhere(rank, world, ps[:1], f"on_nonfinite={on_nonfinite!r}")

    # Partial gradients and a setting invalid on the last rank alone at the first step: the other
    # ranks build their engine meanwhile, which must sum no gradient (a collective the last rank,
    # refusing, does not join); every rank refuses, then they step together.
    ps = [nn.Parameter(distribute_tensor(torch.randn(8, 6) * 0.1, mesh, [Replicate()])) for _ in range(2)]
    opt = dion3.Dion3(ps, distributed_mesh=mesh, lr=0.02)
    for step in range(3):
        for p in ps:
            p.grad = DTensor.from_local(torch.full((8, 6), float(rank + 1)), mesh, [Partial()], run_check=False)
        opt.param_groups[0]["fraction"] = 2.0 if step == 0 and last else 0.25
        if step == 0:
            refused(rank, opt, ps, "fraction" if last else "another rank refused")
        else:
            opt.step()
    same_everywhere(rank, world, ps[:1], "after a first step refused on one rank")




def fully_sharded_model(rank, world, mesh):
    """A real FSDP2 model (fully_shard) trained on identical batches on every rank equals one
    process running the reference rule with ranks=world on the same model."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(16, 32, bias=False), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 10, bias=False))
    single = nn.Sequential(nn.Linear(16, 32, bias=False), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 10, bias=False))
    single.load_state_dict(model.state_dict())
    for layer in (model[0], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    groups = dion3.param_groups(model)
    opt = dion3.Dion3(groups, distributed_mesh=mesh, lr=0.02)
    mats = [p for p in single.parameters() if p.dim() == 2]
    vecs = [p for p in single.parameters() if p.dim() < 2]
    elem_group = next(g for g in groups if g["algorithm"] == "adamw")
    ref_m = Reference(mats, lr=0.02, ranks=world)
    ref_v = Reference(vecs, algorithm="adamw", lr=elem_group.get("lr", 0.02),
                      weight_decay=elem_group.get("weight_decay", 0.01))
    for step in range(3):
        g = torch.Generator().manual_seed(50 + step)
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 10, (8,), generator=g)
        nn.functional.cross_entropy(model(x), y).backward()
        single.zero_grad()
        nn.functional.cross_entropy(single(x), y).backward()
        opt.step()
        opt.zero_grad()
        ref_m.step([p.grad for p in mats])
        ref_v.step([p.grad for p in vecs])
        with torch.no_grad():  # the single model follows the reference's weights
            for p, w in zip(mats, ref_m.w):
                p.copy_(w)
            for p, w in zip(vecs, ref_v.w):
                p.copy_(w)
        for (name, p), (_, q) in zip(model.named_parameters(), single.named_parameters()):
            close(full(p.detach()), q.detach(), f"fully_shard model {name} at step {step}", rtol=1e-4)


def _placed_like(full_tensor, p):
    """This rank's block of a full 2-D tensor, as a DTensor placed like p (any placements, the
    _StridedShard of FSDP2 over tensor parallel included)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    local = full_tensor[offset[0]:offset[0] + shape[0], offset[1]:offset[1] + shape[1]].clone()
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def _tp_model(mesh2d, seed, sizes, style):
    """Bias-free Linear layers of (in, out) `sizes`, parallelized with `style` (ColwiseParallel or
    RowwiseParallel) over mesh2d["tp"], then FSDP2 over mesh2d["dp"]: their full initial weights
    and the sharded parameters."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(i, o, bias=False) for i, o in sizes])
    fulls = [p.detach().clone() for p in model.parameters()]
    parallelize_module(model, mesh2d["tp"], {str(j): style() for j in range(len(sizes))})
    fully_shard(model, mesh=mesh2d["dp"])
    return fulls, list(model.parameters())


def tensor_parallel(rank, world, mesh2d):
    """FSDP2 over ColwiseParallel (rows cut twice, over both mesh dimensions) equals algorithm.md §3's
    local rule with that cut; FSDP2 over RowwiseParallel (row and column blocks) the row-sharded
    rule over the data-parallel dimension, with whole rows."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    dp, tp = mesh2d.size(0), mesh2d.size(1)
    fulls, ps = _tp_model(mesh2d, 4, [(16, 30), (16, 45)], ColwiseParallel)
    opt = dion3.Dion3(ps, distributed_mesh=mesh2d, lr=0.02)

    def two_level(m):  # tensor parallel's chunks, each cut again by FSDP2
        out = []
        ct = -(-m // tp)
        for t in range(tp):
            lo_t, n_t = t * ct, max(0, min(ct, m - t * ct))
            cd = -(-n_t // dp)
            out += [(lo_t + d * cd, max(0, min(cd, n_t - d * cd))) for d in range(dp)]
        return out

    ref = Reference(fulls, lr=0.02, row_shards=two_level)
    steps_match_reference(opt, ref, ps, [tuple(f.shape) for f in fulls], 300, _placed_like,
                          "FSDP2 over ColwiseParallel,")
    assert all(mb["layout"] == "row-sharded" and mb["ranks"] == world for mb in opt.plan()), opt.plan()

    # FSDP2 over RowwiseParallel: rows by dp, columns by tp: the row-sharded rule over dp.
    fulls, ps = _tp_model(mesh2d, 5, [(30, 16), (7, 3)], RowwiseParallel)
    for algo, cls in (("dion3", dion3.Dion3), ("normuon", dion3.NorMuon)):
        for p, f in zip(ps, fulls):
            with torch.no_grad():
                p.to_local().copy_(_placed_like(f, p).to_local())
        opt = cls(ps, distributed_mesh=mesh2d, lr=0.02)
        ref = Reference(fulls, algorithm=algo, lr=0.02, ranks=dp)
        steps_match_reference(opt, ref, ps, [tuple(f.shape) for f in fulls], 400, _placed_like,
                              f"FSDP2 over RowwiseParallel ({algo}),")
        assert all(mb["layout"] == "block-sharded" for mb in opt.plan()), opt.plan()

    # A layer left out of the tensor-parallel plan lives on the data-parallel sub-mesh alone: one
    # optimizer given the whole mesh steps it by the row-sharded rule over dp, next to the TP'd one.
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(16, 30, bias=False), nn.Linear(30, 24, bias=False))
    fulls = [p.detach().clone() for p in model.parameters()]
    parallelize_module(model, mesh2d["tp"], {"0": ColwiseParallel()})
    fully_shard(model[0], mesh=mesh2d["dp"])
    fully_shard(model[1], mesh=mesh2d["dp"])
    ps = list(model.parameters())
    assert ps[0].device_mesh.ndim == 2 and ps[1].device_mesh.ndim == 1
    opt = dion3.Dion3(ps, distributed_mesh=mesh2d, lr=0.02)
    refs = [Reference(fulls[:1], lr=0.02, row_shards=two_level), Reference(fulls[1:], lr=0.02, ranks=dp)]

    class Both:  # the two rules, one per layer
        w = property(lambda self: refs[0].w + refs[1].w)

        def step(self, gs):
            refs[0].step(gs[:1])
            refs[1].step(gs[1:])

    steps_match_reference(opt, Both(), ps, [tuple(f.shape) for f in fulls], 500, _placed_like,
                          "a TP'd layer and a dp-only one, one optimizer,")


def rows_cut_over_one_dimension(rank, world):
    """FSDP2 over ColwiseParallel on a (1, P) or (P, 1) mesh: one dimension does the cutting, the
    rows are the standard ceil(m/P) chunks in rank order, so the global selection scope is taken
    and equals algorithm.md §3's rule with it."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    for shape in ((1, world), (world, 1)):
        mesh2d = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
        fulls, ps = _tp_model(mesh2d, 6, [(16, 30), (16, 45)], ColwiseParallel)
        opt = dion3.Dion3(ps, distributed_mesh=mesh2d, lr=0.02, selection_scope="global")
        ref = Reference(fulls, lr=0.02, ranks=world, selection_scope="global")
        steps_match_reference(opt, ref, ps, [tuple(f.shape) for f in fulls], 500,
                              _placed_like, f"FSDP2 over ColwiseParallel on a {shape} mesh, global scope,")
        assert all(mb["layout"] == "row-sharded" and mb["ranks"] == world for mb in opt.plan()), opt.plan()


def pipeline_stages(rank, world):
    """Two pipeline stages, each with its own (dp, tp) = (1, 2) mesh of a (pp, dp, tp) world mesh:
    each stage's optimizer flattens its own mesh into a process group at the same time as the
    other stage does, and each steps its own matrices (other values on each stage) as one
    process would, a matrix whose rows are cut over both mesh dimensions and a bias sharded on
    both."""
    mesh3 = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
    stage, sub = mesh3.get_local_rank("pp"), mesh3["dp", "tp"]
    tp = sub.get_local_rank(1)
    g = torch.Generator().manual_seed(100 + stage)
    wholes = [torch.randn(8, 6, generator=g) * 0.1, torch.randn(8, generator=g) * 0.1]

    def shard(t):
        return DTensor.from_local(t.chunk(2)[tp].clone(), sub, [Shard(0), Shard(0)], run_check=False,
                                  shape=t.shape, stride=t.stride())

    ps = [nn.Parameter(shard(t)) for t in wholes]
    singles = [nn.Parameter(t.clone()) for t in wholes]
    groups = lambda params: [dict(params=params[:1]), dict(params=params[1:], algorithm="adamw")]  # noqa: E731
    opt = dion3.Muon(groups(ps), distributed_mesh=sub, lr=0.02)
    single = dion3.Muon(groups(singles), lr=0.02)
    for step in range(2):
        grads = [torch.randn(t.shape, generator=g) for t in wholes]
        for p, s, gr in zip(ps, singles, grads):
            p.grad, s.grad = shard(gr), gr.clone()
        opt.step()
        single.step()
    for p, s, what in zip(ps, singles, ("matrix", "bias")):
        close(p.to_local(), s.detach().chunk(2)[tp], f"stage {stage}'s {what} on its own (dp, tp) mesh")


def row_blocks(rank, world, mesh):
    """split_sizes / num_heads. DDP: bit for bit the single-process run. FSDP2 rows that do not
    divide by the world size, cut across the blocks: a block within one rank's shard steps there
    as on one device; one that straddles shards steps with the row-sharded rule over the ranks'
    pieces of it (per-piece selection and NorMuon rescale), computed here block by block."""
    M, n = 40, 32
    for kw, heights in ((dict(split_sizes=(24, 8, 8)), (24, 8, 8)), (dict(num_heads=5), (8,) * 5)):
        torch.manual_seed(0)
        ws = [nn.Parameter(torch.randn(M, n) * 0.05) for _ in range(3)]
        single = [nn.Parameter(w.detach().clone()) for w in ws]
        opt = dion3.Dion3([dict(params=ws, **kw)], distributed_mesh=dist.group.WORLD)
        one = dion3.Dion3([dict(params=single, **kw)])
        for step in range(2):
            for w, s1, g in zip(ws, single, grads_for([(M, n)] * 3, step)):
                w.grad, s1.grad = g.clone(), g.clone()
            opt.step()
            one.step()
            assert all(torch.equal(w, s1) for w, s1 in zip(ws, single)), f"DDP {kw} step {step}"
        for algorithm in ("dion3", "normuon"):
            fulls, ps = sharded_params(mesh, [Shard(0)], seed=5, shapes=[(M, n)] * 2)
            opt = dion3.Dion3([dict(params=ps, algorithm=algorithm, **kw)], distributed_mesh=mesh, lr=0.02)
            c = -(-M // world)
            refs, b0 = [], 0
            for s in heights:
                pieces = [(max(b0, q * c) - b0, min(b0 + s, (q + 1) * c, M) - max(b0, q * c)) for q in range(world)]
                pieces = [(lo, h) for lo, h in pieces if h > 0]
                refs.append((b0, s, [Reference([f[b0:b0 + s]], algorithm=algorithm, lr=0.02, ranks=len(pieces),
                                               row_shards=lambda m, pieces=pieces: pieces) for f in fulls]))
                b0 += s
            for step in range(3):
                gs = grads_for([(M, n)] * 2, 200 + step)
                for p, g in zip(ps, gs):
                    p.grad = distribute_tensor(g, mesh, [Shard(0)])
                opt.step()
                for b0, s, rs in refs:
                    for r, g in zip(rs, gs):
                        r.step([g[b0:b0 + s]])
                for i, p in enumerate(ps):
                    want = torch.cat([rs[i].w[0] for _, _, rs in refs])
                    close(full(p.detach()), want, f"FSDP2 {algorithm} {kw} parameter {i} at step {step}")
            layouts = {mb["layout"] for mb in opt.plan()}
            assert "row-sharded" in layouts, opt.plan()  # some block straddles shards on 2 and 4 ranks


def layouts(rank, world, tmp):
    mesh = init_device_mesh("cpu", (world,))
    ddp(rank, world, dion3.Dion3)
    ddp(rank, world, dion3.NorMuon)
    ddp(rank, world, dion3.Dion2)  # its tall matrix goes by columns on every rank
    ddp(rank, world, dion3.optim.Muon)
    destroyed_group(rank, world)
    for kw in (dict(), dict(selection_scope="global"), dict(fraction=0.5)):
        fsdp(rank, world, mesh, [Shard(0)], world, dion3.Dion3, "dion3", **kw)
    fsdp(rank, world, mesh, [Shard(0)], world, dion3.NorMuon, "normuon")
    fsdp(rank, world, mesh, [Shard(0)], world, dion3.Dion2, "dion2")  # row shards select rows, as the reference
    fsdp(rank, world, mesh, [Shard(1)], 1, dion3.Dion3, "dion3", shapes=COL_SHAPES)
    fsdp(rank, world, mesh, [Shard(1)], 1, dion3.NorMuon, "normuon", shapes=COL_SHAPES)
    torch_muon_sharded(rank, world, mesh)
    if world == 4:  # HSDP: (replicate 2, shard 2), given as the 2-D mesh or its shard sub-mesh
        hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        fsdp(rank, world, hsdp, [Replicate(), Shard(0)], 2, dion3.Dion3, "dion3")
        fsdp(rank, world, hsdp, [Replicate(), Shard(0)], 2, dion3.Dion3, "dion3", pass_mesh=hsdp["shard"])
        # A layer sharded over the shard slice alone would never be averaged over the replicas:
        # given the whole HSDP mesh, it is refused (only the first, data-parallel, slice is taken).
        lone = nn.Parameter(distribute_tensor(torch.randn(8, 6), hsdp["shard"], [Shard(0)]))
        try:
            dion3.Dion3([lone], distributed_mesh=hsdp)
            raise AssertionError("a parameter on the shard slice of an HSDP mesh accepted")
        except ValueError as e:
            assert "lives on" in str(e), str(e)
        tensor_parallel(rank, world, init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
        pipeline_stages(rank, world)
    rows_cut_over_one_dimension(rank, world)
    row_blocks(rank, world, mesh)
    nonfinite(rank, world, mesh)
    state_written_in_place(rank, world, mesh)
    replay_gradients_compared(rank, world, mesh)
    refusals(rank, world, mesh)
    agreement(rank, world, mesh)
    one_rank_changes(rank, world, mesh)
    one_rank_settings(rank, world, mesh)
    partial_gradients(rank, world, mesh)
    one_rank_errors(rank, world, mesh)
    absent_gradients(rank, world, mesh)
    expert_stacks(rank, world, mesh)
    transposed_layouts(rank, world, mesh)
    never_a_gradient(rank, world, mesh)
    fully_sharded_model(rank, world, mesh)


# ---- checkpoints ------------------------------------------------------------------------------

def _model_and_opt(mesh, seed=11):  # FSDP2
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 24, bias=False), nn.ReLU(), nn.Linear(24, 7))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = dion3.Dion3(dion3.param_groups(model), distributed_mesh=mesh, lr=0.02)
    return model, opt


def _train(model, opt, steps, seed):
    for step in range(steps):
        g = torch.Generator().manual_seed(seed + step)
        x = torch.randn(6, 12, generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _full_state(opt):
    sd = opt.state_dict()
    return {(pid, k): full(v).clone() for pid, st in sd["state"].items() for k, v in st.items()
            if isinstance(v, torch.Tensor)}


def _ddp_model_and_opt(seed=11):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 24, bias=False), nn.ReLU(), nn.Linear(24, 7))
    return model, dion3.Dion3(dion3.param_groups(model), distributed_mesh=dist.group.WORLD, lr=0.02)


def _colwise_model_and_opt(mesh, seed=11):
    """Column-sharded weights (Shard(1)): tensor parallel's row-wise split alone."""
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 24, bias=False), nn.ReLU(), nn.Linear(24, 7, bias=False))
    parallelize_module(model, mesh, {"2": RowwiseParallel(input_layouts=Replicate())})
    return model, dion3.Dion3(list(model.parameters()), distributed_mesh=mesh, lr=0.02)


def _tp_model_and_opt(mesh2d, seed=11):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 26, bias=False), nn.ReLU(), nn.Linear(26, 12, bias=False))
    parallelize_module(model, mesh2d["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh2d["dp"])
    return model, dion3.Dion3(list(model.parameters()), distributed_mesh=mesh2d, lr=0.02)


def _resume_bit_for_bit(make, path):
    """Train, save, train on; a fresh model and optimizer (other weights) loaded from the
    checkpoint train on the same way, bit for bit, with equal state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = make(11)
    _train(model, opt, 2, seed=0)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    saved = _full_state(opt)
    _train(model, opt, 2, seed=10)
    after = [full(p.detach()).clone() for p in model.parameters()]
    model2, opt2 = make(99)
    msd2, osd2 = get_state_dict(model2, opt2)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = _full_state(opt2)
    assert loaded.keys() == saved.keys()
    for key in saved:
        assert torch.equal(loaded[key], saved[key]), f"state {key} after dcp.load ({path})"
    _train(model2, opt2, 2, seed=10)
    for i, (p, a) in enumerate(zip(model2.parameters(), after)):
        assert torch.equal(full(p.detach()), a), f"parameter {i} after resuming differs ({path})"
    return saved


def checkpoint_save(rank, world, tmp):
    """DCP round trips on `world` ranks that resume bit for bit: FSDP2 (its checkpoint is kept for
    checkpoint_reshard), DDP and FSDP2 over tensor parallel."""
    mesh = init_device_mesh("cpu", (world,))
    saved = _resume_bit_for_bit(lambda seed: _model_and_opt(mesh, seed), os.path.join(tmp, "ckpt"))
    if rank == 0:
        torch.save(saved, os.path.join(tmp, "saved_state.pt"))
    _resume_bit_for_bit(_ddp_model_and_opt, os.path.join(tmp, "ckpt-ddp"))
    model, opt = _model_and_opt(mesh, seed=3)  # a per-rank file, which checkpoint_reshard cannot gather
    _train(model, opt, 1, seed=0)
    torch.save(opt.state_dict(), os.path.join(tmp, f"optim-rank{rank}.pt"))
    _resume_bit_for_bit(lambda seed: _colwise_model_and_opt(mesh, seed), os.path.join(tmp, "ckpt-cols"))
    if world == 4:
        mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        _resume_bit_for_bit(lambda seed: _tp_model_and_opt(mesh2d, seed), os.path.join(tmp, "ckpt-tp"))
        # Into FSDP2 over tensor parallel: the first layer's rows are cut twice (_StridedShard, Shard).
        single = nn.Sequential(nn.Linear(12, 26, bias=False), nn.ReLU(), nn.Linear(26, 12, bias=False))
        _single_device_round_trip(single, list(single.parameters()), lambda: _tp_model_and_opt(mesh2d, seed=9),
                                  "FSDP2 x TP")
        hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        _resume_bit_for_bit(lambda seed: _model_and_opt(hsdp, seed), os.path.join(tmp, "ckpt-hsdp"))


def checkpoint_reshard(rank, world, tmp):
    """The checkpoint saved on 4 ranks loads on `world` ranks (resharded), and a single-device
    state_dict loads into the sharded optimizer and comes back equal."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    mesh = init_device_mesh("cpu", (world,))
    model, opt = _model_and_opt(mesh, seed=5)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=os.path.join(tmp, "ckpt"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    saved = torch.load(os.path.join(tmp, "saved_state.pt"))
    loaded = _full_state(opt)
    for key in saved:
        assert torch.equal(loaded[key], saved[key]), f"state {key} resharded from 4 to {world} ranks"
    _train(model, opt, 1, seed=20)  # and it steps

    single = nn.Sequential(nn.Linear(12, 24, bias=False), nn.ReLU(), nn.Linear(24, 7))
    _single_device_round_trip(single, dion3.param_groups(single), lambda: _model_and_opt(mesh, seed=7), "FSDP2")
    _refused_loads(rank, world, mesh)
    # This rank's file of the 4-rank run (torch.save, not DCP) into a DDP optimizer: its DTensors
    # live on a mesh this world cannot gather from, and the load says so, changing nothing.
    _, ddp_opt = _ddp_model_and_opt()
    per_rank = torch.load(os.path.join(tmp, f"optim-rank{rank}.pt"), weights_only=False)
    try:
        ddp_opt.load_state_dict(per_rank)
        raise AssertionError(f"rank {rank}: another world's per-rank state_dict was loaded")
    except ValueError as e:
        assert "cannot gather it from" in str(e) or "refused the state_dict" in str(e), str(e)


def _single_device_round_trip(single, groups, make_sharded, what):
    """A single-device optimizer's state_dict loads into a sharded one (each rank keeps its own
    part), comes back equal through state_dict(), and the sharded optimizer steps."""
    torch.manual_seed(7)
    for p in single.parameters():  # fresh weights from the seed, the same on every rank
        nn.init.normal_(p, std=0.1)
    sopt = dion3.Dion3(groups, lr=0.02)
    _train(single, sopt, 2, seed=30)
    single_sd = sopt.state_dict()
    model, opt = make_sharded()
    opt.load_state_dict(single_sd)
    back = _full_state(opt)
    for pid, st in single_sd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(back[(pid, k)], v), f"single-device state {pid}/{k} through {what}"
    _train(model, opt, 1, seed=32)


def _refused_loads(rank, world, mesh):
    """A state_dict that is bad in one rank's part only is refused on every rank (that rank names
    the tensor, the others name that rank) and changes nothing anywhere: FSDP2 state with a NaN in
    one rank's shard, a single-device state_dict whose negative variance lies in rows only one rank
    keeps, and DDP (replicated) state that differs on one rank."""
    import copy

    bad_rank = world - 1

    def copied(sd, tensor=lambda v: v):
        return {"state": {pid: {k: tensor(v) if isinstance(v, torch.Tensor) else v for k, v in st.items()}
                          for pid, st in sd["state"].items()},
                "param_groups": copy.deepcopy(sd["param_groups"])}

    def load_refused(opt, sd, what):
        try:
            opt.load_state_dict(sd)
        except ValueError as e:
            expect = what if rank == bad_rank else f"rank {bad_rank} refused the state_dict"
            assert expect in str(e), f"rank {rank}: {e}"
            return
        raise AssertionError(f"rank {rank}: a state_dict with a bad {what} was loaded")

    model, opt = _model_and_opt(mesh, seed=13)
    _train(model, opt, 1, seed=40)
    before = _full_state(opt)
    sharded = copied(opt.state_dict())
    m = sharded["state"][0]["momentum"]
    local = m.to_local().clone()
    if rank == bad_rank:
        local.view(-1)[0] = float("nan")
    sharded["state"][0]["momentum"] = DTensor.from_local(local, m.device_mesh, m.placements, run_check=False,
                                                         shape=m.shape, stride=m.stride())
    load_refused(opt, sharded, "state 'momentum' (float32) (this rank's shard) holds NaN at element 0")
    single = copied(opt.state_dict(), lambda v: full(v).clone())
    single["state"][0]["variance_neuron"][-1] = -1.0  # the last row: the last rank's shard
    load_refused(opt, single, "state 'variance_neuron' (float32) (this rank's shard) holds -1.0")
    after = _full_state(opt)
    assert after.keys() == before.keys()
    for key in before:
        assert torch.equal(after[key], before[key]), f"rank {rank}: state {key} changed by a refused load"
    _train(model, opt, 1, seed=41)  # and it steps

    model, opt = _ddp_model_and_opt(seed=13)
    _train(model, opt, 1, seed=40)
    replicated = copied(opt.state_dict(), lambda v: v.clone())
    if rank == bad_rank:
        replicated["state"][1]["momentum"][0, 0] = float("inf")
    before = _full_state(opt)
    load_refused(opt, replicated, "state 'momentum' (float32) holds +Inf at element 0")
    # Refused from its metadata alone (a shape) on one rank: the others refuse too, and none hangs
    # in the next step's collectives.
    truncated = copied(opt.state_dict(), lambda v: v.clone())
    if rank == bad_rank:
        truncated["state"][1]["momentum"] = truncated["state"][1]["momentum"][:1]
    load_refused(opt, truncated, "state 'momentum' has shape [1,")
    after = _full_state(opt)
    for key in before:
        assert torch.equal(after[key], before[key]), f"rank {rank}: DDP state {key} changed by a refused load"
    _train(model, opt, 1, seed=41)
