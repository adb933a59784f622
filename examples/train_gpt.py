#!/usr/bin/env python3
"""examples/train_gpt.py — the main job: train a small GPT with Dion3, Muon, NorMuon and AdamW on
the same data, and show the result on one page.

The corpus is the Python standard library's own source text, read as bytes (a vocabulary of 256,
nothing to download, present on every machine with Python). Every optimizer sees the same
initial weights and the same batches in the same order. At the end the run writes, in --out:
  loss.png    validation loss against step and against wall-clock time, one line per optimizer
  results.md  final validation loss, the optimizer's share of step time, tokens/s, peak memory
              (GPU: the run's allocated peak; CPU: the process's resident peak, cumulative)
  history.json  every run's validation losses by step and by wall-clock second
  ckpt-<optimizer>.pt  a checkpoint per optimizer, so an interrupted run resumes (--resume)
               exactly where it stopped (Ctrl-C or SIGTERM saves at the end of the step it is in,
               and stops; after a kill, the last evaluation's checkpoint). On the CPU, with the same
               number of threads, the resumed run computes the same bits as one that never
               stopped; on a GPU PyTorch's backward kernels are not deterministic, so it matches
               one as closely as two uninterrupted runs match each other.
  run-<optimizer>.json  each finished run's record (no weights), for --report-only
  .lock       held while a session trains there: a second session on the same --out is refused

Exit status: 0 when every run finished; 3 when --time-limit (or --stop-after) stopped one (--resume goes on);
130 after Ctrl-C and 143 after SIGTERM (both saved: --resume goes on).

    python examples/train_gpt.py                        # the CPU default: under 10 minutes on 2 cores
    python examples/train_gpt.py --preset gpu-125m      # a 125M-parameter GPT on one GPU
    python examples/train_gpt.py --preset gpu-1b --optimizers dion3,adamw   # time 1B-scale steps
    python examples/train_gpt.py --help

Learning rates: Muon and NorMuon at --lr; Dion3 at --lr / sqrt(f) (the 1/sqrt(f) rule: a step
that moves f of the rows moves them further); embeddings, the head and vectors with AdamW at
--adamw-lr; AdamW alone at --adamw-lr. A run whose loss (or validation loss) turns non-finite
stops there and is reported as diverged; a sweep goes on with the next run. A finished run stays
finished when only settings it does not use change (Muon's lr for AdamW, Dion3's fraction for
the others).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import signal
import sys
import sysconfig
import threading
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

OPTIMIZERS = ("dion3", "muon", "normuon", "adamw")
# The integer settings of a preset that the command line may override.
INT_KEYS = ("n_layer", "d_model", "n_head", "seq_len", "batch", "steps", "eval_every", "eval_batches")

# name: (layers, d_model, heads, seq_len, batch, steps, corpus MB, eval every, eval batches)
PRESETS = {
    "cpu": dict(n_layer=4, d_model=128, n_head=4, seq_len=128, batch=16, steps=800, corpus_mb=8,
                eval_every=100, eval_batches=8, corpus="stdlib"),
    "tiny": dict(n_layer=2, d_model=64, n_head=2, seq_len=64, batch=8, steps=20, corpus_mb=1,
                 eval_every=10, eval_batches=2, corpus="stdlib"),
    "gpu-small": dict(n_layer=6, d_model=384, n_head=6, seq_len=256, batch=64, steps=2000, corpus_mb=64,
                      eval_every=200, eval_batches=20, corpus="stdlib"),
    # GPT-2 small's shape with a byte vocabulary (86M parameters); 1526 steps of 64 x 1024 tokens
    # are 100M tokens: ten passes over the standard library alone, so this one reads the installed
    # packages' source too.
    "gpu-125m": dict(n_layer=12, d_model=768, n_head=12, seq_len=1024, batch=64, steps=1526, corpus_mb=256,
                     eval_every=218, eval_batches=20, corpus="python"),
    # The benchmark's gpt-1b shapes (16 layers of 2048, 805M parameters): a few steps to time a real
    # training step (forward, backward, optimizer) with each optimizer, not a training run.
    "gpu-1b": dict(n_layer=16, d_model=2048, n_head=16, seq_len=1024, batch=16, steps=40, corpus_mb=64,
                   eval_every=40, eval_batches=4, corpus="python"),
}


# ---- data -----------------------------------------------------------------------------------

CORPORA = ("stdlib", "python")


def source_files(corpus: str) -> List[str]:
    """The .py files of a corpus in its reading order. "stdlib": the standard library, in sorted
    path order. "python": the standard library and the installed packages (site-packages), in an
    order fixed by a hash of each file's path below its root, so that the held-out tail (and a
    --corpus-mb cut) samples every package instead of the last ones in the alphabet."""
    paths = sysconfig.get_paths()
    roots = [paths["stdlib"]]
    if corpus == "python":
        roots += sorted({paths["purelib"], paths["platlib"]} - {paths["stdlib"]})
    files = []
    for root in roots:
        skip = {"__pycache__"} if corpus == "python" and root != paths["stdlib"] else \
            {"site-packages", "dist-packages", "__pycache__"}
        for d, dirs, names in os.walk(root):
            dirs[:] = sorted(x for x in dirs if x not in skip)
            files += [(root, os.path.join(d, n)) for n in sorted(names) if n.endswith(".py")]
    if corpus == "stdlib":
        return sorted(p for _, p in files)
    key = lambda rp: hashlib.sha256(os.path.relpath(rp[1], rp[0]).encode()).hexdigest()
    return [p for _, p in sorted(set(files), key=lambda rp: (key(rp), rp[1]))]


def read_corpus(corpus: str, max_bytes: int) -> bytes:
    """The corpus's .py files joined, at most max_bytes."""
    out, size, cut = [], 0, False
    for path in source_files(corpus):
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            continue
        out.append(data)
        size += len(data) + 1
        if size >= max_bytes:
            cut = True
            break
    text = b"\n".join(out)[:max_bytes]
    if len(text) < 100_000:
        if cut:
            raise SystemExit(f"train_gpt: --corpus-mb {max_bytes / 2**20:g} keeps only {len(text)} bytes; "
                             "the demo needs at least 100 kB")
        raise SystemExit(f"train_gpt: the {corpus} corpus ({sysconfig.get_paths()['stdlib']}) holds only "
                         f"{len(text)} bytes of .py source; the demo needs at least 100 kB")
    return text


class Batches:
    """Random windows of the training split; the generator's state is part of a checkpoint, so the
    order is the same for every optimizer and after a resume."""

    def __init__(self, data: torch.Tensor, batch: int, seq_len: int, seed: int):
        self.data, self.batch, self.seq_len = data, batch, seq_len
        self.gen = torch.Generator().manual_seed(seed)

    def next(self):
        i = torch.randint(0, len(self.data) - self.seq_len - 1, (self.batch,), generator=self.gen)
        return windows(self.data, i.tolist(), self.seq_len)


def windows(data: torch.Tensor, starts: List[int], seq_len: int):
    """Inputs and next-byte targets of the windows of seq_len bytes at `starts`."""
    w = torch.stack([data[s:s + seq_len + 1] for s in starts])
    return w[:, :-1].long(), w[:, 1:].long()


def eval_windows(data: torch.Tensor, n: int, batch: int, seq_len: int):
    """Fixed validation batches: evenly spaced windows of the validation split."""
    count = n * batch
    stride = max(1, (len(data) - seq_len - 1) // count)
    x, y = windows(data, [k * stride for k in range(count)], seq_len)
    return list(zip(x.split(batch), y.split(batch)))


# ---- model ----------------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, n_layer: int, d_model: int, n_head: int, seq_len: int):
        super().__init__()
        self.embed = nn.Embedding(256, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, 256, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer) if name.endswith(("proj.weight", "down.weight"))
                                else 0.02)

    def forward(self, idx, targets):
        x = self.embed(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.lm_head(self.ln(x)).float()
        return F.cross_entropy(logits.view(-1, 256), targets.reshape(-1))


# ---- optimizers -----------------------------------------------------------------------------

ADAMW_BETAS = (0.9, 0.95)


def make_optimizer(name: str, model: GPT, cfg: "Config"):
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=cfg.adamw_lr, betas=ADAMW_BETAS, weight_decay=0.0)
    import dion3
    lr = lr_of(name, cfg)
    groups = dion3.param_groups(model, lm_head=model.lm_head, lr=cfg.adamw_lr,
                                elementwise_options=dict(lr=cfg.adamw_lr, betas=ADAMW_BETAS, weight_decay=0.0))
    kw = dict(fraction=cfg.fraction) if name == "dion3" else {}
    cls = {"dion3": dion3.Dion3, "muon": dion3.Muon, "normuon": dion3.NorMuon}[name]
    return cls(groups, lr=lr, weight_decay=0.0, **kw)


def schedule(step: int, cfg: "Config") -> float:
    """Linear warm-up over 5% of the steps, then linear decay to 10%."""
    warm = max(1, cfg.steps // 20)
    if step < warm:
        return (step + 1) / warm
    return 1.0 - 0.9 * (step - warm) / max(1, cfg.steps - warm)


# ---- one run --------------------------------------------------------------------------------

@dataclass
class Config:
    n_layer: int
    d_model: int
    n_head: int
    seq_len: int
    batch: int
    steps: int
    corpus_mb: float
    eval_every: int
    eval_batches: int
    lr: float
    adamw_lr: float
    fraction: float
    seed: int
    corpus: str = "stdlib"  # records written before the choice existed read the standard library


class Progress:
    """One line on stderr, redrawn: step, tokens/s, training loss, the last validation loss."""

    def __init__(self, label: str, total: int):
        self.label, self.total = label, total
        self.tty = sys.stderr.isatty()
        self.last_line = 0.0

    def show(self, step: int, tokens_per_s: float, loss: float, val: Optional[float], final=False):
        now = time.time()
        if not final and not self.tty and now - self.last_line < 10:
            return  # a log file gets a line every 10 s, a terminal a redrawn bar
        self.last_line = now
        width = 24
        done = int(width * step / self.total)
        bar = "#" * done + "." * (width - done)
        v = f" val {val:.3f}" if val is not None else ""
        line = f"{self.label:>8} [{bar}] {step}/{self.total}  {tokens_per_s / 1e3:7.1f}k tok/s  loss {loss:.3f}{v}"
        sys.stderr.write(("\r" + line) if self.tty else (line + "\n"))
        if final and self.tty:
            sys.stderr.write("\n")
        sys.stderr.flush()


def autocast(device):
    """bf16 matrix products on a GPU (weights and optimizer state stay float32); none on the CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


def evaluate(model, windows, device):
    model.eval()
    with torch.no_grad(), autocast(device):
        losses = [model(x.to(device), y.to(device)).item() for x, y in windows]
    model.train()
    return sum(losses) / len(losses)


def peak_rss_bytes() -> Optional[int]:
    try:
        import resource
    except ImportError:  # not on every platform
        return None
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb * (1 if sys.platform == "darwin" else 1024)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Run:
    """One optimizer at one learning rate: its name in files and tables, and its settings."""
    name: str
    optimizer: str
    cfg: Config
    scale: float = 1.0


def runs_of(names: List[str], cfg: Config, scales: List[float], fractions: Optional[List[float]] = None) -> List[Run]:
    """Each optimizer at each lr scale: the optimizer's own lr times the scale (AdamW alone: its lr;
    the others: the matrix lr; the element-wise groups beside them keep --adamw-lr); Dion3 at each
    of `fractions` (default: cfg.fraction), named dion3-f<f> when there are several."""
    fractions = fractions or [cfg.fraction]
    out = []
    for name in names:
        for f in fractions if name == "dion3" else [cfg.fraction]:
            base = f"dion3-f{f:g}" if name == "dion3" and len(fractions) > 1 else name
            for s in scales:
                c = replace(cfg, adamw_lr=cfg.adamw_lr * s) if name == "adamw" else replace(cfg, lr=cfg.lr * s)
                out.append(Run(base if len(scales) == 1 else f"{base}@{s:g}x", name, replace(c, fraction=f), s))
    names = [r.name for r in out]
    same = sorted({n for n in names if names.count(n) > 1})
    if same:  # their checkpoints and records would be one file
        raise SystemExit(f"train_gpt: runs {', '.join(same)} would share a name (fractions or lr scales equal to "
                         "six significant digits); choose values further apart")
    return out


def label_of(run: Run, fraction_format: str) -> str:
    """The run's name, with Dion3's fraction where the name does not carry it."""
    if run.optimizer == "dion3" and "-f" not in run.name:
        return run.name + fraction_format.format(run.cfg.fraction)
    return run.name


def family(run: Run) -> str:
    """What the report compares: an optimizer, Dion3 at each fraction apart."""
    return f"dion3 f={run.cfg.fraction:g}" if run.optimizer == "dion3" else run.optimizer


def base_lr(run: Run, key: str) -> float:
    """--lr or --adamw-lr (key "lr" or "adamw_lr") as given for `run`: without the run's scale,
    which multiplies AdamW's own lr and the others' matrix lr (runs_of)."""
    scaled = (run.optimizer == "adamw") == (key == "adamw_lr")
    return getattr(run.cfg, key) / (run.scale if scaled else 1.0)


def lr_of(optimizer: str, c: "Config") -> float:
    """The optimizer's lr: AdamW's own; Dion3's matrix lr / sqrt(f); Muon's and NorMuon's matrix lr."""
    return c.adamw_lr if optimizer == "adamw" else c.lr / math.sqrt(c.fraction) if optimizer == "dion3" else c.lr


class Stop:
    """Why a run saves at the end of its step and stops (resumable), if it should: --time-limit's
    wall-clock second has passed, or Ctrl-C or SIGTERM came (what a job scheduler, `timeout` or
    `docker stop` sends; a second signal quits at once, unsaved). As a context manager it holds the
    two handlers: in the main thread, where the signals have Python's default handlers (ones
    ignored or set by the caller are left alone)."""

    NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}
    DEFAULTS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}

    def __init__(self, seconds: Optional[float]):
        self.at = None if seconds is None else time.time() + seconds
        self.signal: Optional[int] = None  # the signal that asked to stop
        self._installed: List[int] = []

    def exit_status(self) -> int:
        """A stop's exit status: 128 + the signal, as a shell reports one; 3 for --time-limit."""
        return 128 + int(self.signal) if self.signal is not None else 3

    def reason(self) -> Optional[str]:
        if self.signal is not None:
            return self.NAMES[self.signal]
        return "--time-limit" if self.at is not None and time.time() >= self.at else None

    def _on_signal(self, signum, frame):
        if self.signal is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)
        self.signal = signum
        name = self.NAMES[signum]
        print(f"\ntrain_gpt: {name}: saving at the end of this step ({name} again quits without saving)",
              file=sys.stderr)

    def __enter__(self) -> "Stop":
        if threading.current_thread() is threading.main_thread():
            for sig, default in self.DEFAULTS.items():
                if signal.getsignal(sig) is default:
                    signal.signal(sig, self._on_signal)
                    self._installed.append(sig)
        return self

    def __exit__(self, *exc) -> None:
        for sig in self._installed:
            signal.signal(sig, self.DEFAULTS[sig])
        self._installed = []


def replace_atomically(path: str, write: Callable[[str], None]) -> None:
    """Writes path whole or not at all (write(tmp) then a rename): an interruption, or a disk that
    fills up, leaves the previous version; the latter stops the session with a one-line message."""
    tmp = path + ".tmp"
    try:
        write(tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch.save reports a short write as a RuntimeError
        try:
            os.remove(tmp)
        except OSError:
            pass
        try:
            free = f"; {shutil.disk_usage(os.path.dirname(path) or '.').free / 1e6:.0f} MB free there"
        except OSError:
            free = ""
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).strip().splitlines()[0]
        raise SystemExit(f"train_gpt: could not write {path} ({why}{free}); the version before it is kept") from None


def write_atomically(path: str, text: str) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)
    replace_atomically(path, write)


def same_data(what: str, theirs: Optional[str], ours: str) -> None:
    """Refuses to go on from a checkpoint or record of other data (another Python, other packages)."""
    if theirs and ours and theirs != ours:
        raise SystemExit(f"train_gpt: {what} was trained on other data ({theirs}); this machine reads {ours}. "
                         "Remove it, or go on where the data is the same")


# Settings an optimizer's run does not read (the rest, and the fraction, for Muon and NorMuon).
UNUSED_SETTINGS = {"adamw": ("lr", "fraction"), "dion3": ()}


def same_settings(run: Run, config) -> bool:
    """Whether a saved config is `run`'s in the settings its optimizer uses: Dion3's fraction, and
    the matrix lr, mean nothing to AdamW's run (and the fraction to Muon's and NorMuon's)."""
    unused = UNUSED_SETTINGS.get(run.optimizer, ("fraction",))

    def used(c: Dict) -> Dict:
        return {k: v for k, v in c.items() if k not in unused}
    return isinstance(config, dict) and used(config) == used(asdict(run.cfg))


def finished_record(run: Run, out: str) -> Optional[Dict]:
    """The run's record in `out` if it finished with these settings, else None."""
    record = os.path.join(out, f"run-{run.name}.json")
    if not os.path.exists(record):
        return None
    try:
        with open(record) as f:
            rec = json.load(f)
        return rec if same_settings(run, rec["config"]) and rec["state"].get("done") else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # unreadable: the run is trained again and the record rewritten


def check_checkpoints(runs: List[Run], out: str, resume: bool) -> None:
    """Before any training, what would stop a later run, said up front rather than after the runs
    before it trained: without --resume, a checkpoint of a run that is unfinished or has other
    settings (it would be overwritten); with it, a checkpoint that cannot be read or has other
    settings (loaded mapped: its tensors are not read here)."""
    if resume and not any(os.path.exists(os.path.join(out, f"{kind}-{run.name}.{ext}"))
                          for run in runs for kind, ext in (("ckpt", "pt"), ("run", "json"))):
        print(f"train_gpt: --resume: {out} holds none of these runs; training them from the start", file=sys.stderr)
    for run in runs:
        path = os.path.join(out, f"ckpt-{run.name}.pt")
        if not os.path.exists(path):
            continue
        if not resume and finished_record(run, out) is None:
            raise SystemExit(f"train_gpt: {path} holds a run that is unfinished or has other settings; add --resume "
                             "to go on from it (same settings), or remove it or pass another --out to start again")
        if resume:
            check_settings(path, load_checkpoint(path, "cpu", mmap=True), run)


def check_settings(path: str, ck: Dict, run: Run) -> None:
    if not same_settings(run, ck["config"]):
        saved, now = ck["config"], asdict(run.cfg)
        unused = UNUSED_SETTINGS.get(run.optimizer, ("fraction",))
        diff = [f"{k} {saved.get(k)!r} (now {v!r})" for k, v in now.items()
                if isinstance(saved, dict) and saved.get(k) != v and k not in unused][:4]
        raise SystemExit(f"train_gpt: {path} was written with other settings ({', '.join(diff) or 'unreadable'}); "
                         "pass those settings to go on from it, or remove it or pass another --out to start again")


def load_checkpoint(path: str, device, mmap: bool = False) -> Dict:
    """A checkpoint this script wrote, or a one-line reason why the file is not one."""
    try:
        ck = torch.load(path, map_location=device, weights_only=False, mmap=mmap)
    except Exception as e:  # noqa: BLE001 - a truncated, empty or foreign file: torch's errors vary
        raise SystemExit(f"train_gpt: cannot read {path} ({type(e).__name__}: {e}); remove it to train that run "
                         "again") from None
    if not isinstance(ck, dict) or "config" not in ck:
        raise SystemExit(f"train_gpt: {path} is not a checkpoint of this script; remove it to train that run again")
    return ck


def non_finite_weights(model: nn.Module) -> List[str]:
    """The names of the model's floating-point tensors that hold NaN or Inf."""
    return [k for k, t in model.state_dict().items() if t.is_floating_point() and not bool(t.isfinite().all())]


def train_one(run: Run, train: torch.Tensor, val_windows, device, out: str, resume: bool,
              stop_after: Optional[int], stop: Stop, corpus_info: str = "") -> Dict:
    """Trains (or resumes) one run; returns its history and summary."""
    name, cfg = run.name, run.cfg
    path = os.path.join(out, f"ckpt-{name}.pt")
    record = os.path.join(out, f"run-{name}.json")
    rec = finished_record(run, out)

    def write_record(state):
        # The run's record without the weights: what --report-only reads, from any number of sessions.
        write_atomically(record, json.dumps(dict(name=name, optimizer=run.optimizer, scale=run.scale,
                                                 config=asdict(cfg), state=state)))

    if resume and not os.path.exists(path) and rec is not None:
        # A run finished on another machine: its record (without weights) is all the report needs.
        same_data(record, rec["state"].get("corpus"), corpus_info)
        print(f"{name}: finished earlier ({record})", file=sys.stderr)
        return rec["state"]
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.n_layer, cfg.d_model, cfg.n_head, cfg.seq_len).to(device)
    opt = make_optimizer(run.optimizer, model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: schedule(s, cfg))
    batches = Batches(train, cfg.batch, cfg.seq_len, cfg.seed)
    state = dict(step=0, elapsed=0.0, opt_seconds=0.0, history=[], done=False)
    if resume and os.path.exists(path):
        ck = load_checkpoint(path, device)
        check_settings(path, ck, run)
        same_data(path, ck.get("corpus"), corpus_info)
        try:
            model.load_state_dict(ck["model"])
            opt.load_state_dict(ck["optimizer"])
            sched.load_state_dict(ck["scheduler"])
            # map_location moved the RNG states to the device too; generators take theirs on the CPU.
            batches.gen.set_state(ck["batches"].cpu())
            torch.set_rng_state(ck["torch_rng"].cpu())
            state = dict(ck["state"])
            int(state["step"]), bool(state["done"]), list(state["history"])  # raise if missing
            bad = [] if state["done"] else non_finite_weights(model)
            if bad:  # a damaged file: an unfinished run is saved with finite weights
                raise ValueError(f"the weights hold NaN or Inf ({', '.join(bad[:3])})")
        except torch.cuda.OutOfMemoryError:
            raise  # the machine's, not the checkpoint's
        except Exception as e:  # noqa: BLE001 - readable, but its contents damaged: the loaders' errors vary
            raise SystemExit(f"train_gpt: {path} cannot be resumed ({type(e).__name__}: {e}); remove it to train "
                             "that run again") from None
        del ck  # the checkpoint's tensors (on the device) would count in the peak memory
        if state["done"]:
            print(f"{name}: finished earlier ({path})", file=sys.stderr)
            if rec is None:  # stopped between the checkpoint and the record
                write_record(state)
            return state
        print(f"{name}: resuming at step {state['step']}", file=sys.stderr)

    def save():
        ckpt = dict(config=asdict(cfg), corpus=corpus_info, model=model.state_dict(), optimizer=opt.state_dict(),
                    scheduler=sched.state_dict(), batches=batches.gen.get_state(), torch_rng=torch.get_rng_state(),
                    state=state)
        replace_atomically(path, lambda tmp: torch.save(ckpt, tmp))  # never a half-written checkpoint
        if not state["done"] and os.path.exists(record):
            # A finished run's record must not vouch for an unfinished checkpoint (one trained again
            # from the start): a plain re-run would overwrite it instead of asking for --resume.
            os.remove(record)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    progress = Progress(name, cfg.steps)
    tokens = cfg.batch * cfg.seq_len
    val = state["history"][-1]["val"] if state["history"] else None
    ran = 0
    # A non-finite loss, and dion3's refusal of a non-finite gradient (on_nonfinite="raise").
    nonfinite = (FloatingPointError,) + ((sys.modules["dion3"].NonFiniteError,) if "dion3" in sys.modules else ())
    sync(device)  # each step below ends synchronised, so its successor's clock starts clean
    while state["step"] < cfg.steps:
        t0 = time.perf_counter()
        x, y = batches.next()
        with autocast(device):
            loss = model(x.to(device), y.to(device))
        loss.backward()
        sync(device)
        train_loss = loss.item()
        t1 = time.perf_counter()
        try:
            if not math.isfinite(train_loss):
                raise FloatingPointError
            opt.step()
        except nonfinite:
            # Diverged (the lr is too large): this run ends here, a sweep goes on with the next.
            state["diverged"] = state["step"] + 1
            print(f"\n{name}: the loss or a gradient is not finite at step {state['diverged']}; the run ends here "
                  "as diverged", file=sys.stderr)
            break
        sync(device)
        t2 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        sched.step()
        state["step"] += 1
        state["elapsed"] += t2 - t0
        state["opt_seconds"] += t2 - t1
        ran += 1
        step = state["step"]
        if step % cfg.eval_every == 0 or step == cfg.steps:
            val = evaluate(model, val_windows, device)
            if not math.isfinite(val) or non_finite_weights(model):  # the weights themselves went non-finite
                state["diverged"] = step
                print(f"\n{name}: the validation loss is not finite at step {step}; the run ends here as diverged",
                      file=sys.stderr)
                break
            state["history"].append(dict(step=step, seconds=state["elapsed"], val=val, train=train_loss))
            save()
        progress.show(step, tokens * step / max(state["elapsed"], 1e-9), train_loss, val, final=step == cfg.steps)
        why = "--stop-after" if stop_after is not None and ran >= stop_after else stop.reason()
        if why and step < cfg.steps and non_finite_weights(model):
            # Saved unfinished only with finite weights (what resuming checks): this step diverged.
            state["diverged"] = step
            print(f"\n{name}: the weights are not finite at step {step}; the run ends here as diverged",
                  file=sys.stderr)
            break
        if why and step < cfg.steps:
            save()
            print(f"\n{name}: stopped at step {step} ({why}); --resume goes on", file=sys.stderr)
            return state
    state["done"] = True
    state["peak_memory"] = (torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None)
    # On the CPU: the process's high-water mark so far (it includes the runs before this one).
    state["peak_rss"] = peak_rss_bytes()
    state["optimizer_state_bytes"] = sum(t.numel() * t.element_size() for st in opt.state.values()
                                         for t in st.values() if torch.is_tensor(t))
    state["parameters"] = sum(p.numel() for p in model.parameters())
    state["device"], state["corpus"] = str(device), corpus_info
    save()
    write_record(state)
    return state


# ---- report ---------------------------------------------------------------------------------

def report_order(run: Run):
    """The table's row order, the same whether the runs were just trained or read from records:
    optimizers as OPTIMIZERS lists them, Dion3's larger fraction first, then ascending lr scale."""
    return OPTIMIZERS.index(run.optimizer), -run.cfg.fraction, run.scale


def write_report(runs: List[Run], results: Dict[str, Dict], cfg: Config, out: str, device,
                 corpus_info: str) -> None:
    runs = sorted(runs, key=report_order)
    done = [r for r in runs if results[r.name].get("history") or results[r.name].get("diverged")]

    def final(r: Run) -> float:  # a diverged run (or one with a non-finite loss) ranks last
        st = results[r.name]
        v = st["history"][-1]["val"] if st.get("history") and not st.get("diverged") else math.inf
        return v if math.isfinite(v) else math.inf

    sweep = len(done) > len({family(r) for r in done})  # some optimizer at several learning rates
    best = {}
    for r in done:  # each optimizer's (and Dion3 fraction's) run with the lowest final validation loss
        if math.isfinite(final(r)) and (family(r) not in best or final(r) < final(best[family(r)])):
            best[family(r)] = r
    fractions = ", ".join(f"{f:g}" for f in dict.fromkeys(r.cfg.fraction for r in runs if r.optimizer == "dion3"))
    first = results[done[0].name] if done else {}

    def given_lr(key: str) -> str:
        """--lr or --adamw-lr: one value, or "per run" where records of several sessions differ."""
        values = {f"{base_lr(r, key):g}" for r in runs}
        return values.pop() if len(values) == 1 else "per run (the table's lr column)"
    lines = [f"# Train a GPT: {', '.join(dict.fromkeys(r.optimizer for r in runs))}", "",
             f"- model: {cfg.n_layer} layers, d_model {cfg.d_model}, {cfg.n_head} heads, "
             f"{first.get('parameters', 0) / 1e6:.2f}M parameters; "
             f"{cfg.steps} steps of {cfg.batch} x {cfg.seq_len} bytes "
             f"({cfg.steps * cfg.batch * cfg.seq_len / 1e6:.3g}M tokens); device {device}",
             f"- data: {corpus_info}",
             f"- lr: Muon and NorMuon --lr {given_lr('lr')}, Dion3 --lr / sqrt(f) (f = {fractions or cfg.fraction}), "
             f"AdamW --adamw-lr {given_lr('adamw_lr')} (also Dion3's and Muon's embeddings, head and vectors), times "
             f"each run's scale; seed {cfg.seed}", "",
             "| run | lr | final val loss | optimizer share of step time | tokens/s | peak memory | optimizer state |",
             "|---|---|---|---|---|---|---|"]
    for r in done:
        st = results[r.name]
        loss = (f"diverged (step {st['diverged']})" if st.get("diverged") else f"{st['history'][-1]['val']:.4f}")
        share = 100 * st["opt_seconds"] / max(st["elapsed"], 1e-9)
        tps = st["step"] * cfg.batch * cfg.seq_len / max(st["elapsed"], 1e-9)
        peak = (f"{st['peak_memory'] / 2**20:.0f} MiB" if st.get("peak_memory") else
                f"{st['peak_rss'] / 2**20:.0f} MiB (process)" if st.get("peak_rss") else "n/a")
        state_mb = f"{st.get('optimizer_state_bytes', 0) / 2**20:.1f} MiB"
        label = label_of(r, " (f = {:g})")
        if best.get(family(r)) is r and sweep:
            label = f"**{label}**"
        lines.append(f"| {label} | {lr_of(r.optimizer, r.cfg):.4g} | {loss} | {share:.1f}% | {tps:,.0f} | {peak} | {state_mb} |")
    if sweep:
        lines += ["", "Bold: each optimizer's best learning rate (the plot shows those)."]
    write_atomically(os.path.join(out, "results.md"), "\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("train_gpt: matplotlib is not installed; no plot (scripts/setup-python.sh installs it)",
              file=sys.stderr)
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for r in best.values():
        h = results[r.name]["history"]
        label = label_of(r, " f={:g}") + f", lr {lr_of(r.optimizer, r.cfg):.3g}"
        # Markers: a run evaluated once (gpu-1b's default) is one point, which a bare line leaves out.
        a.plot([e["step"] for e in h], [e["val"] for e in h], label=label, marker=".")
        b.plot([e["seconds"] for e in h], [e["val"] for e in h], label=label, marker=".")
    a.set_xlabel("step")
    b.set_xlabel("wall-clock seconds (training steps only)")
    for ax in (a, b):
        ax.set_ylabel("validation loss (nats per byte)")
        ax.grid(alpha=0.3)
        if best:  # every run diverged: nothing to label
            ax.legend()
    fig.suptitle(f"GPT, {cfg.n_layer} layers x {cfg.d_model}, {device}")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "loss.png"), dpi=110)
    plt.close(fig)


# ---- command line ---------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="sizes and steps (default: cpu without a GPU, gpu-small with one; gpu-1b is "
                         "for timing a few steps of a 1B-scale model)")
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS),
                    help=f"comma-separated, from {', '.join(OPTIMIZERS)} (default: all)")
    for key in INT_KEYS:
        ap.add_argument("--" + key.replace("_", "-"), type=int, default=None, help="overrides the preset")
    ap.add_argument("--corpus-mb", type=float, default=None, help="source text to read, in MiB")
    ap.add_argument("--corpus", choices=CORPORA, default=None,
                    help="stdlib: the standard library's source; python: it and the installed packages' "
                         "(default: python for gpu-125m and gpu-1b, stdlib otherwise)")
    ap.add_argument("--lr", type=float, default=0.02,
                    help="Muon / NorMuon lr (default 0.02); Dion3 takes lr / sqrt(f)")
    ap.add_argument("--adamw-lr", type=float, default=None,
                    help="AdamW's lr, alone and for Dion3/Muon's embeddings, head and vectors (default: 3e-3, "
                         "1e-3 for gpu-125m and gpu-1b)")
    ap.add_argument("--fraction", default="0.25",
                    help="Dion3's f (default 1/4); several, comma-separated, train Dion3 at each")
    ap.add_argument("--lr-scales", default="1",
                    help="comma-separated multipliers of each optimizer's lr, one run each (a sweep: "
                         "0.5,1,2); the table marks and the plot shows each optimizer's best")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds; then the current run saves and stops (exit status 3), and --resume goes on")
    ap.add_argument("--seed", type=seed_arg, default=0)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when a GPU is visible)")
    ap.add_argument("--out", default="train_gpt_out",
                    help="folder for the plot, table and checkpoints (relative to the current directory)")
    ap.add_argument("--resume", action="store_true", help="go on from the checkpoints in --out")
    ap.add_argument("--report-only", action="store_true",
                    help="train nothing: write the table and plot from the run-*.json records in --out "
                         "(runs finished in several sessions, copied into one folder)")
    ap.add_argument("--stop-after", type=int, default=None, help=argparse.SUPPRESS)  # tests: an interruption
    a = ap.parse_args(argv)
    names = list(dict.fromkeys(n.strip() for n in a.optimizers.split(",") if n.strip()))
    bad = [n for n in names if n not in OPTIMIZERS]
    if bad or not names:
        ap.error(f"--optimizers: unknown {', '.join(bad) or '(none given)'}; choose from {', '.join(OPTIMIZERS)}")
    def numbers(flag: str, text: str, ok, wrong: str) -> List[float]:
        """A comma-separated list of distinct numbers each passing ok(), or the parser's error."""
        try:
            xs = [float(x) for x in text.split(",") if x.strip()]
        except ValueError:
            ap.error(f"{flag}: expected numbers, got {text!r}")
        if not xs or len(set(xs)) != len(xs) or not all(ok(x) for x in xs):
            ap.error(wrong)
        return xs

    a.fractions = numbers("--fraction", str(a.fraction), lambda f: 0.0 < f <= 1.0,
                          f"--fraction must be in (0, 1] (distinct values when several), got {a.fraction}")
    if a.device is None:
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif a.device not in ("cpu", "cuda") and not a.device.startswith("cuda:"):
        ap.error(f"--device must be cpu or cuda, got {a.device!r}")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: PyTorch sees no GPU here")
    preset_name = a.preset or ("cpu" if a.device == "cpu" else "gpu-small")
    preset = dict(PRESETS[preset_name])
    if a.adamw_lr is None:
        a.adamw_lr = 1e-3 if preset_name in ("gpu-125m", "gpu-1b") else 3e-3  # larger models, a smaller AdamW lr
    for key in ("lr", "adamw_lr"):
        v = getattr(a, key)
        if not (math.isfinite(v) and v > 0):
            ap.error(f"--{key.replace('_', '-')} must be a positive number, got {v}")
    for key in list(preset):
        if getattr(a, key, None) is not None:
            preset[key] = getattr(a, key)
    for key in INT_KEYS:
        if preset[key] < 1:
            ap.error(f"--{key.replace('_', '-')} must be at least 1, got {preset[key]}")
    if preset["d_model"] % preset["n_head"]:
        ap.error(f"--d-model ({preset['d_model']}) must be a multiple of --n-head ({preset['n_head']})")
    if not (math.isfinite(preset["corpus_mb"]) and preset["corpus_mb"] > 0):
        ap.error(f"--corpus-mb must be a positive number, got {preset['corpus_mb']}")
    scales = numbers("--lr-scales", a.lr_scales, lambda x: math.isfinite(x) and x > 0,
                     f"--lr-scales: expected distinct positive numbers, got {a.lr_scales!r}")
    if a.time_limit is not None and not a.time_limit > 0:
        ap.error(f"--time-limit must be a positive number of seconds, got {a.time_limit}")
    cfg = Config(**preset, lr=a.lr, adamw_lr=a.adamw_lr, fraction=a.fractions[0], seed=a.seed)
    a.scales = scales
    return a, names, cfg


def report_only(out: str) -> int:
    records, files = [], {}
    for f in sorted(os.listdir(out)) if os.path.isdir(out) else []:
        if f.startswith("run-") and f.endswith(".json"):
            try:
                with open(os.path.join(out, f)) as fh:
                    rec = json.load(fh)
                Config(**rec["config"])  # raises unless the record holds a whole configuration
                if not isinstance(rec["state"], dict) or not all(k in rec for k in ("name", "optimizer", "scale")):
                    raise KeyError("name, optimizer, scale or state")
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                print(f"train_gpt: --report-only: skipping {f}, which cannot be read ({type(e).__name__}: {e})",
                      file=sys.stderr)
                continue
            records.append(rec)
            name = records[-1]["name"]
            if name in files:  # the table and plot are keyed by run name: one record per run
                raise SystemExit(f"train_gpt: --report-only: {files[name]} and {f} are both run {name!r}; "
                                 "keep one of them in the folder")
            files[name] = f
    if not records:
        raise SystemExit(f"train_gpt: --report-only: no run-*.json records in {out}")
    runs = sorted((Run(r["name"], r["optimizer"], Config(**r["config"]), r["scale"]) for r in records),
                  key=report_order)
    first = runs[0]
    cfg = replace(first.cfg, lr=base_lr(first, "lr"), adamw_lr=base_lr(first, "adamw_lr"))
    shapes = {tuple((k, v) for k, v in r["config"].items() if k not in ("lr", "adamw_lr", "fraction"))
              for r in records}
    if len(shapes) > 1:
        raise SystemExit("train_gpt: --report-only: the records were trained with different settings "
                         "(besides the learning rates and Dion3's fraction); keep one setting per folder")
    for key, what in (("corpus", "data"), ("device", "kinds of device")):
        seen = sorted({str(r["state"].get(key)) for r in records if r["state"].get(key)})
        if len(seen) > 1:  # the table's header names one of each, and the runs would not compare
            raise SystemExit(f"train_gpt: --report-only: the records were trained on different {what} "
                             f"({'; '.join(seen)}); keep one per folder")
    results = {r["name"]: r["state"] for r in records}
    info = records[0]["state"].get("corpus", "see the runs' logs")
    write_report(runs, results, cfg, out, records[0]["state"].get("device", "?"), info)
    return 0


def seed_arg(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not -2**62 <= v < 2**62:  # torch seeds are 64-bit, and the GPU warm-up takes seed + 1
        raise argparse.ArgumentTypeError(f"must be an integer in [-2**62, 2**62), got {v}")
    return v


def main(argv=None) -> int:
    a, names, cfg = parse_args(argv)
    if a.report_only:
        try:
            return report_only(a.out)
        except OSError as e:
            raise SystemExit(f"train_gpt: --report-only: {e.filename or a.out}: {e.strerror or e}") from None
    device = torch.device(a.device)
    if device.type == "cpu":
        print(f"train_gpt: no GPU in use; training on the CPU ({torch.get_num_threads()} threads)"
              + ("" if a.device == "cpu" and not torch.cuda.is_available() else " as asked"), file=sys.stderr)
    runs = runs_of(names, cfg, a.scales, a.fractions)
    for run in runs:  # the lrs the optimizers take (scales, Dion3's 1/sqrt(f)), stepped in float32:
        # adjust_lr scales a matrix's lr by up to 2 here (sqrt of the MLP's 4d x d shape); torch's
        # AdamW divides its first step's lr by 1 - beta1 (and raises where that overflows).
        if run.optimizer == "adamw":
            factor, by = 1 / (1 - ADAMW_BETAS[0]), f"torch's AdamW's first step (lr / (1 - {ADAMW_BETAS[0]:g}))"
        else:
            factor, by = 2.0, "adjust_lr (up to 2x here)"
        for v in {lr_of(run.optimizer, run.cfg), run.cfg.adamw_lr}:
            if not v * factor <= torch.finfo(torch.float32).max:
                raise SystemExit(f"train_gpt: run {run.name} would step with lr {v:g}, which {by} takes beyond "
                                 "float32's range; choose smaller --lr, --adamw-lr or --lr-scales "
                                 "(or a larger --fraction)")
    try:
        os.makedirs(a.out, exist_ok=True)
        # One session a folder: two would write the same checkpoints. The lock also shows, before
        # any training, that the folder can be written to.
        lock = open(os.path.join(a.out, ".lock"), "w")
    except OSError as e:
        raise SystemExit(f"train_gpt: --out {a.out}: {e.strerror or e}") from None
    with lock:
        try:
            import fcntl  # POSIX; elsewhere sessions are not kept apart
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:
            pass
        except OSError:
            raise SystemExit(f"train_gpt: --out {a.out} is in use by another session; wait for it, or pass "
                             "another --out") from None
        return train_all(a, cfg, runs, device)


def train_all(a, cfg: Config, runs: List[Run], device) -> int:
    check_checkpoints(runs, a.out, a.resume)
    text = read_corpus(cfg.corpus, int(cfg.corpus_mb * 2**20))
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    cut = int(len(data) * 0.95)
    train, val = data[:cut], data[cut:]
    if len(val) <= cfg.seq_len + 1:
        raise SystemExit(f"train_gpt: the validation split ({len(val)} bytes) is shorter than a window; "
                         "raise --corpus-mb or lower --seq-len")
    if cfg.eval_batches * cfg.batch > len(val) - cfg.seq_len - 1:
        raise SystemExit(f"train_gpt: the validation split ({len(val)} bytes) holds fewer than --eval-batches x "
                         f"--batch = {cfg.eval_batches * cfg.batch} windows; raise --corpus-mb or lower --eval-batches")
    what = "standard library" if cfg.corpus == "stdlib" else "standard library and installed packages'"
    corpus_info = (f"Python {sys.version.split()[0]} {what} source, {len(text) / 2**20:.1f} MiB "
                   f"(sha256 {hashlib.sha256(text).hexdigest()[:12]}), last 5% held out")
    windows = eval_windows(val, cfg.eval_batches, cfg.batch, cfg.seq_len)
    if device.type == "cuda":
        # The process's CUDA start-up (context, cuBLAS, kernel loading) is paid here, untimed, not
        # by whichever optimizer runs first.
        warm = GPT(cfg.n_layer, cfg.d_model, cfg.n_head, cfg.seq_len).to(device)
        x, y = Batches(train, cfg.batch, cfg.seq_len, cfg.seed + 1).next()
        for _ in range(3):
            with autocast(device):
                warm(x.to(device), y.to(device)).backward()
        evaluate(warm, windows[:1], device)
        del warm
        sync(device)
    results = {}
    with Stop(a.time_limit) as stop:
        for i, run in enumerate(runs):
            if i > 0 and stop.reason() is not None:  # during the previous run's end: the next does not start
                return stop.exit_status()
            results[run.name] = train_one(run, train, windows, device, a.out, a.resume, a.stop_after, stop,
                                          corpus_info)
            if not results[run.name].get("done"):
                # Stopped on purpose (--stop-after, --time-limit, a signal); --resume goes on.
                return stop.exit_status()
        # Still under the handlers: a first Ctrl-C here lets the report be written whole.
        write_report(runs, results, cfg, a.out, device, corpus_info)
        write_atomically(os.path.join(a.out, "history.json"),
                         json.dumps({n: r["history"] for n, r in results.items()}, indent=1))
    where = os.path.abspath(a.out)
    print(f"train_gpt: wrote {where}/results.md and {where}/loss.png", file=sys.stderr)
    return 0  # every run finished and the report is written, even if a signal came during it


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # outside a run's steps (reading the corpus), or a second Ctrl-C
        print("\ntrain_gpt: interrupted; finished and saved runs are kept, --resume goes on", file=sys.stderr)
        sys.exit(130)
