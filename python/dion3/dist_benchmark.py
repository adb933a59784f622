# dist_benchmark.py — `torchrun --nproc-per-node P -m dion3.dist_benchmark`: dion3's distributed
# layouts (algorithm.md §3) through torch.distributed, timed and counted. On every rank it builds a
# model's matrices in each layout — DDP (plain replicated tensors, distributed_mesh = the process
# group) and FSDP2 row shards (DTensors with Shard(0), local and global selection scope) — once
# megabatched and once with one collective per matrix, steps them, and prints on rank 0, per
# layout: the median step time of the slowest rank, the collective rounds and the bytes each rank
# sends per step (from the engine's plan), and the megabatched/per-matrix ratio measured in the
# same run. gloo on CPU tensors, NCCL on GPUs. Not a test: it asserts nothing.
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import dion3
from dion3.benchmark import MODELS, at_least, fraction_arg, listed, model_shapes

MODELS_WITH_SMALL = dict(MODELS, **{"gpt-small": (12, 768, 4 * 768)})


def shapes_of(name: str, layers: int):
    if name == "gpt-small":
        n_layers, d, mlp = MODELS_WITH_SMALL[name]
        return ([(d, d)] * 4 + [(mlp, d), (d, mlp)]) * (layers or n_layers)
    return model_shapes(name, layers)[0]


def build(layout, shapes, device, dtype, mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    params = []
    gen = torch.Generator(device=device).manual_seed(0)  # the same values on every rank
    for s in shapes:
        w = (torch.randn(s, generator=gen, device=device) * 0.02).to(dtype)
        g = torch.randn(s, generator=gen, device=device).to(dtype)
        if layout in ("ddp", "local"):
            p = torch.nn.Parameter(w)
            p.grad = g
        else:
            p = torch.nn.Parameter(distribute_tensor(w, mesh, [Shard(0)]))
            p.grad = distribute_tensor(g, mesh, [Shard(0)])
        params.append(p)
    return params


def time_steps(opt, iters, device):
    opt.step()  # plan, workspace, first collectives
    times = []
    for _ in range(iters):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = torch.tensor([1e3 * (time.perf_counter() - t0)], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank
        times.append(t.item())
    return statistics.median(times)


LAYOUTS = ("local", "ddp", "fsdp", "fsdp-global")


def layout_name(text: str) -> str:
    if text not in LAYOUTS:
        raise ValueError(f"{text!r} is none of {', '.join(LAYOUTS)}")
    return text


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node P -m dion3.dist_benchmark",
        description="dion3's distributed layouts through torch.distributed (gloo on CPU tensors, NCCL on GPUs): "
                    "per layout, the median step time of the slowest rank, the collective rounds and bytes each "
                    "rank sends per step, megabatched against one collective per matrix.")
    ap.add_argument("--model", default="gpt-small", choices=sorted(MODELS_WITH_SMALL))
    ap.add_argument("--layers", type=at_least(0), default=2, help="first N layers (default 2; 0: all)")
    ap.add_argument("--fraction", type=fraction_arg, default=0.25, help="Dion3's fraction f, in (0, 1]")
    ap.add_argument("--iters", type=at_least(1), default=5, help="timed steps (the median is reported)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    ap.add_argument("--layouts", type=listed(layout_name, "layouts"), default="ddp,fsdp,fsdp-global",
                    help="comma-separated, from local (single-device path, the baseline), ddp, fsdp, fsdp-global")
    ap.add_argument("--repeat", type=at_least(1), default=1, help="run the layout list N times in a row")
    args = ap.parse_args(argv)
    if "RANK" not in os.environ:
        ap.error("run it under torchrun (torchrun --nproc-per-node P -m dion3.dist_benchmark), which sets RANK "
                 "and the rendezvous")

    cuda = torch.cuda.is_available() and os.environ.get("DION3_BENCH_DEVICE", "") != "cpu"
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,))
    shapes = shapes_of(args.model, args.layers)
    if rank == 0:
        layers = args.layers or MODELS_WITH_SMALL[args.model][0]
        print(f"dion3.dist_benchmark: {args.model}, {layers} layers ({len(shapes)} matrices), Dion3 "
              f"f = {args.fraction:g}, {device.type} {str(dtype).replace('torch.', '')}, {world} ranks "
              f"({backend}), median of {args.iters} steps (slowest rank)\n")
        print("| layout | collectives | megabatches | rounds/step | MiB sent/rank/step | step ms | "
              "megabatched vs per matrix |\n|---|---|---|---|---|---|---|")
    local_ms = None
    for layout in args.layouts * args.repeat:
        per = None
        for megabatch in ((True,) if layout == "local" else (False, True)):
            params = build(layout, shapes, device, dtype, mesh)
            scope = "global" if layout == "fsdp-global" else "local"
            where = None if layout == "local" else dist.group.WORLD if layout == "ddp" else mesh
            opt = dion3.Dion3(params, distributed_mesh=where, fraction=args.fraction, selection_scope=scope,
                              megabatch=megabatch)
            ms = time_steps(opt, args.iters, device)
            plan = opt.plan()
            rounds = sum(mb["rounds"] for mb in plan)
            sent = sum(mb["bytes_sent"] for mb in plan) / 2**20
            if layout == "local":
                local_ms = ms
            if rank == 0:
                notes = []
                if megabatch and per is not None:
                    notes.append(f"{per / ms:.2f}x faster")
                if layout != "local" and local_ms and megabatch:
                    notes.append(f"{100 * (ms / local_ms - 1):+.1f}% vs single-device")
                kind = "none" if layout == "local" else "megabatched" if megabatch else "one per matrix"
                print(f"| {layout} | {kind} | {len(plan)} | {rounds} | {sent:.2f} | {ms:.2f} | {'; '.join(notes)} |",
                      flush=True)
            per = ms
            del opt, params
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
