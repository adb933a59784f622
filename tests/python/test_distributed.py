# test_distributed.py — dion3's distributed layouts (algorithm.md §3) through torch.distributed on the CPU:
# 2 and 4 gloo ranks spawned by the test itself, each launch bounded in time. The checks live in
# dist_workers.py: DDP equals one process bit for bit; row-sharded DTensors (FSDP2, uneven and
# empty shards, HSDP) and a real fully_shard model equal algorithm.md §3's rule computed in one process;
# non-finite gradients on one rank and bad layouts are decided alike on every rank; DCP save /
# load resumes bit for bit and reshards from 4 ranks to 2; a single-device state_dict loads into
# a sharded optimizer and back; a state_dict bad on one rank only is refused on every rank, as are
# errors of other kinds there and a replicated weight's Partial gradient absent there; two pipeline
# stages, each on its own (dp, tp) mesh, step as one process would.
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LAUNCH_TIMEOUT = 240  # seconds for one launch (startup of 4 ranks on 2 cores included)

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def launch(world, name, tmp, *args):
    """Runs dist_workers.<name>(rank, world, tmp, *args) on `world` gloo ranks; fails with the
    ranks' tracebacks, or after LAUNCH_TIMEOUT seconds."""
    import dist_workers

    tmp = str(tmp)
    for f in os.listdir(tmp):
        if f.startswith(("error.", "fault.")) or f == "store":
            os.remove(os.path.join(tmp, f))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=dist_workers.run, args=(r, world, tmp, name, args)) for r in range(world)]
    start = time.time()
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(1.0, LAUNCH_TIMEOUT - (time.time() - start)))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errors = []
    for r in range(world):
        path = os.path.join(tmp, f"error.{r}")
        if os.path.exists(path):
            with open(path) as f:
                errors.append(f"--- rank {r} ---\n{f.read()}")
    assert not errors, "\n".join(errors)
    assert not hung, f"ranks {hung} still running after {LAUNCH_TIMEOUT} s"
    crashed = [r for r, p in enumerate(procs) if p.exitcode != 0]
    faults = []
    for r in crashed:
        path = os.path.join(tmp, f"fault.{r}")
        if os.path.exists(path):
            with open(path) as f:
                faults.append(f"--- rank {r} (exit code {procs[r].exitcode}) ---\n{f.read()}")
    assert not crashed, "\n".join(faults) or [p.exitcode for p in procs]
    print(f"[ {name} on {world} ranks: {time.time() - start:.1f} s ]")


@pytest.fixture(autouse=True)
def _workers_importable():
    # Spawned ranks import dist_workers (and reference) from this folder.
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    old = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = here + (os.pathsep + old if old else "")
    yield
    os.environ["PYTHONPATH"] = old


@pytest.mark.parametrize("world", [2, 4])
def test_layouts_equal_the_single_process_rules(world, tmp_path):
    launch(world, "layouts", tmp_path)


def test_checkpoint_resumes_bit_for_bit_and_reshards(tmp_path):
    launch(4, "checkpoint_save", tmp_path)
    launch(2, "checkpoint_reshard", tmp_path)
