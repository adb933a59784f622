# test_demo.py — the main job (examples/train_gpt.py) on the CPU at its smallest: it trains every
# optimizer, writes the table and the plot, refuses bad arguments with a message, and a run
# interrupted and resumed computes the same bits as one that never stopped.
import importlib.util
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("train_gpt", os.path.join(ROOT, "examples", "train_gpt.py"))
train_gpt = importlib.util.module_from_spec(_spec)
sys.modules["train_gpt"] = train_gpt  # dataclasses look their module up there
_spec.loader.exec_module(train_gpt)

TINY = ["--preset", "tiny", "--device", "cpu", "--steps", "8", "--eval-every", "4", "--corpus-mb", "0.5"]


def test_every_optimizer_trains_and_the_report_is_written(tmp_path):
    assert train_gpt.main(TINY + ["--out", str(tmp_path)]) == 0
    table = (tmp_path / "results.md").read_text()
    for name in ("dion3 (f = 0.25)", "muon", "normuon", "adamw"):
        assert f"| {name} |" in table
    assert (tmp_path / "loss.png").stat().st_size > 10_000
    hist = train_gpt.json.loads((tmp_path / "history.json").read_text())
    for name, h in hist.items():
        assert [e["step"] for e in h] == [4, 8]
        assert h[-1]["val"] < 5.4, name  # below the uniform guess, ln 256 = 5.55


def test_an_interrupted_run_resumes_bit_for_bit(tmp_path):
    args = TINY + ["--optimizers", "dion3,adamw"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert train_gpt.main(args + ["--out", str(whole)]) == 0
    assert train_gpt.main(args + ["--out", str(parts), "--stop-after", "3"]) == 3   # dion3 stops at step 3
    assert train_gpt.main(args + ["--out", str(parts), "--resume", "--stop-after", "2"]) == 3  # at 5
    assert train_gpt.main(args + ["--out", str(parts), "--resume"]) == 0
    for name in ("dion3", "adamw"):
        a = torch.load(whole / f"ckpt-{name}.pt", weights_only=False)
        b = torch.load(parts / f"ckpt-{name}.pt", weights_only=False)
        assert a["state"]["step"] == b["state"]["step"] == 8
        for k, v in a["model"].items():
            assert torch.equal(v, b["model"][k]), f"{name} {k}"
        strip = [(e["step"], e["val"], e["train"]) for e in a["state"]["history"]]
        assert strip == [(e["step"], e["val"], e["train"]) for e in b["state"]["history"]], name


def test_a_learning_rate_sweep_marks_each_optimizers_best_run(tmp_path):
    assert train_gpt.main(TINY + ["--optimizers", "muon,adamw", "--lr-scales", "0.5,2", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "results.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "@" in line]
    assert len(rows) == 4 and sum("**" in r for r in rows) == 2
    assert "| muon@0.5x | 0.01 |" in table.replace("**", "") and "| adamw@2x | 0.006 |" in table.replace("**", "")
    assert (tmp_path / "loss.png").exists()
    # The same report from the runs' records alone, as from runs finished in several sessions.
    (tmp_path / "results.md").unlink()
    assert train_gpt.main(["--report-only", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "results.md").read_text() == table


def test_dion3_at_several_fractions_is_compared_fraction_by_fraction(tmp_path):
    assert train_gpt.main(TINY + ["--optimizers", "dion3", "--fraction", "0.5,0.25", "--lr-scales", "1,2",
                                  "--out", str(tmp_path)]) == 0
    table = (tmp_path / "results.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "dion3-f" in line]
    assert len(rows) == 4 and sum("**" in r for r in rows) == 2  # a best run per fraction
    assert "| dion3-f0.25@1x | 0.04 |" in table.replace("**", "")  # lr / sqrt(f)
    assert "Dion3 --lr / sqrt(f) (f = 0.5, 0.25)" in table
    (tmp_path / "results.md").unlink()  # the records of both fractions make one report
    assert train_gpt.main(["--report-only", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "results.md").read_text() == table
    # A record copied in twice (under another file name) would be one run twice: refused.
    copy = tmp_path / "run-copy.json"
    copy.write_text((tmp_path / "run-dion3-f0.25@1x.json").read_text())
    with pytest.raises(SystemExit, match="are both run 'dion3-f0.25@1x'"):
        train_gpt.main(["--report-only", "--out", str(tmp_path)])
    copy.unlink()
    # On another machine only the records travel: --resume takes finished runs from them.
    for ck in tmp_path.glob("ckpt-*.pt"):
        ck.unlink()
    (tmp_path / "results.md").unlink()
    assert train_gpt.main(TINY + ["--optimizers", "dion3", "--fraction", "0.5,0.25", "--lr-scales", "1,2",
                                  "--out", str(tmp_path), "--resume"]) == 0
    assert (tmp_path / "results.md").read_text() == table and not list(tmp_path.glob("ckpt-*.pt"))


def test_a_time_limit_stops_and_resume_goes_on_bit_for_bit(tmp_path):
    args = TINY + ["--optimizers", "dion3"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert train_gpt.main(args + ["--out", str(whole)]) == 0
    assert train_gpt.main(args + ["--out", str(parts), "--time-limit", "1e-6"]) == 3  # stops after one step
    ck = torch.load(parts / "ckpt-dion3.pt", weights_only=False)
    assert ck["state"]["step"] == 1 and not ck["state"]["done"]
    assert train_gpt.main(args + ["--out", str(parts), "--resume"]) == 0
    a = torch.load(whole / "ckpt-dion3.pt", weights_only=False)["model"]
    b = torch.load(parts / "ckpt-dion3.pt", weights_only=False)["model"]
    assert all(torch.equal(v, b[k]) for k, v in a.items())


def test_a_time_limit_passed_at_the_end_of_a_run_starts_no_other(tmp_path):
    # One step a run: the limit has passed when adamw's run ends, and muon's does not begin.
    args = TINY + ["--optimizers", "adamw,muon", "--steps", "1", "--eval-every", "1", "--out", str(tmp_path)]
    assert train_gpt.main(args + ["--time-limit", "1e-6"]) == 3
    assert (tmp_path / "ckpt-adamw.pt").exists() and not (tmp_path / "ckpt-muon.pt").exists()
    assert train_gpt.main(args + ["--resume"]) == 0


def test_a_checkpoint_that_cannot_be_written_stops_with_a_message_and_keeps_the_last(tmp_path):
    args = TINY + ["--optimizers", "adamw", "--out", str(tmp_path)]
    assert train_gpt.main(args + ["--stop-after", "4"]) == 3
    before = (tmp_path / "ckpt-adamw.pt").read_bytes()
    (tmp_path / "ckpt-adamw.pt.tmp").mkdir()  # where the next checkpoint would be written first
    with pytest.raises(SystemExit, match=r"could not write .*ckpt-adamw\.pt \(.*Is a directory.*; .* MB free there\); "
                                         "the version before it is kept"):
        train_gpt.main(args + ["--resume"])
    assert (tmp_path / "ckpt-adamw.pt").read_bytes() == before
    (tmp_path / "ckpt-adamw.pt.tmp").rmdir()
    assert train_gpt.main(args + ["--resume"]) == 0


@pytest.mark.parametrize("signame, status", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_saves_at_the_end_of_the_step_and_resume_goes_on_bit_for_bit(tmp_path, monkeypatch, signame, status):
    # The first Ctrl-C or SIGTERM (a job scheduler's; raised here as step 3 is shown) lets the step
    # finish, saves and stops with the shell's status; --resume then computes what one run would have.
    import signal
    sig = getattr(signal, signame)
    args = TINY + ["--optimizers", "dion3"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert train_gpt.main(args + ["--out", str(whole)]) == 0
    show = train_gpt.Progress.show

    def interrupting(self, step, *rest, **kw):
        show(self, step, *rest, **kw)
        if step == 3:
            signal.raise_signal(sig)
    monkeypatch.setattr(train_gpt.Progress, "show", interrupting)
    held = signal.getsignal(sig)
    assert train_gpt.main(args + ["--out", str(parts)]) == status
    assert signal.getsignal(sig) is held  # the handler is put back
    ck = torch.load(parts / "ckpt-dion3.pt", weights_only=False)
    assert ck["state"]["step"] == 3 and not ck["state"]["done"]
    monkeypatch.setattr(train_gpt.Progress, "show", show)
    assert train_gpt.main(args + ["--out", str(parts), "--resume"]) == 0
    a = torch.load(whole / "ckpt-dion3.pt", weights_only=False)["model"]
    b = torch.load(parts / "ckpt-dion3.pt", weights_only=False)["model"]
    assert all(torch.equal(v, b[k]) for k, v in a.items())


@pytest.mark.parametrize("argv, message", [
    (["--optimizers", "dion3,sgd"], "--optimizers: unknown sgd"),
    (["--fraction", "0"], "--fraction must be in"),
    (["--fraction", "0.5,0.5"], "distinct values when several"),
    (["--d-model", "66", "--n-head", "4"], "must be a multiple of --n-head"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--lr", "-1"], "--lr must be a positive number"),
    (["--device", "tpu"], "--device must be cpu or cuda"),
    (["--lr-scales", "1,x"], "--lr-scales: expected numbers"),
    (["--lr-scales", "1,1"], "--lr-scales: expected distinct positive numbers"),
    (["--time-limit", "0"], "--time-limit must be a positive number"),
    (["--corpus", "wiki"], "invalid choice: 'wiki'"),
    (["--corpus-mb", "nan"], "--corpus-mb must be a positive number"),
    (["--corpus-mb", "inf"], "--corpus-mb must be a positive number"),
])
def test_bad_arguments_are_refused_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        train_gpt.parse_args(["--preset", "tiny"] + argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_resuming_with_other_settings_is_refused(tmp_path):
    args = TINY + ["--optimizers", "dion3", "--out", str(tmp_path)]
    assert train_gpt.main(args + ["--stop-after", "2"]) == 3
    with pytest.raises(SystemExit, match=r"written with other settings \(lr 0.02 \(now 0.03\)\); pass those "
                                         "settings to go on from it, or remove it or pass another --out"):
        train_gpt.main(args + ["--resume", "--lr", "0.03"])


def test_an_unfinished_checkpoint_is_not_overwritten_without_resume(tmp_path):
    args = TINY + ["--optimizers", "adamw", "--out", str(tmp_path)]
    assert train_gpt.main(args + ["--stop-after", "6"]) == 3
    with pytest.raises(SystemExit, match="unfinished or has other settings; add --resume"):
        train_gpt.main(args)
    assert torch.load(tmp_path / "ckpt-adamw.pt", weights_only=False)["state"]["step"] == 6
    assert train_gpt.main(args + ["--resume"]) == 0
    assert train_gpt.main(args) == 0  # a finished run may be trained again from the start
    # ... and when that retraining stops, its record no longer vouches for the unfinished checkpoint.
    assert train_gpt.main(args + ["--stop-after", "5"]) == 3
    with pytest.raises(SystemExit, match="unfinished or has other settings; add --resume"):
        train_gpt.main(args)
    assert torch.load(tmp_path / "ckpt-adamw.pt", weights_only=False)["state"]["step"] == 5


def test_an_unfinished_checkpoint_is_found_before_any_run_trains(tmp_path):
    # Without --resume the refusal comes first, not after the runs before it trained again.
    args = TINY + ["--optimizers", "muon,adamw", "--out", str(tmp_path)]
    assert train_gpt.main(args) == 0
    muon = (tmp_path / "ckpt-muon.pt").stat().st_mtime_ns
    ck = torch.load(tmp_path / "ckpt-adamw.pt", weights_only=False)
    ck["state"]["done"] = False
    torch.save(ck, tmp_path / "ckpt-adamw.pt")
    (tmp_path / "run-adamw.json").unlink()
    with pytest.raises(SystemExit, match="ckpt-adamw.pt holds a run that is unfinished"):
        train_gpt.main(args)
    assert (tmp_path / "ckpt-muon.pt").stat().st_mtime_ns == muon


def test_a_later_checkpoint_with_other_settings_is_found_before_resuming(tmp_path):
    # With --resume too: a later run's checkpoint of other settings stops the job before the runs
    # before it go on.
    args = TINY + ["--optimizers", "muon,adamw", "--out", str(tmp_path)]
    assert train_gpt.main(args + ["--stop-after", "2"]) == 3  # muon stopped at step 2
    ck = torch.load(tmp_path / "ckpt-muon.pt", weights_only=False)
    ck["config"]["adamw_lr"] = 0.5  # a setting AdamW's run uses (Muon's lr it does not)
    torch.save(ck, tmp_path / "ckpt-adamw.pt")
    muon = (tmp_path / "ckpt-muon.pt").stat().st_mtime_ns
    with pytest.raises(SystemExit, match="ckpt-adamw.pt was written with other settings"):
        train_gpt.main(args + ["--resume"])
    assert (tmp_path / "ckpt-muon.pt").stat().st_mtime_ns == muon


@pytest.mark.parametrize("content, message", [
    (b"", "cannot read"), (b"not a checkpoint", "cannot read"), (None, "is not a checkpoint of this script")])
def test_a_damaged_or_foreign_checkpoint_is_refused_in_one_line(tmp_path, content, message):
    path = tmp_path / "ckpt-adamw.pt"
    if content is None:
        torch.save({"weights": torch.zeros(2)}, path)
    else:
        path.write_bytes(content)
    with pytest.raises(SystemExit, match=message):
        train_gpt.main(TINY + ["--optimizers", "adamw", "--out", str(tmp_path), "--resume"])


def test_a_checkpoint_that_reads_but_does_not_load_is_refused_in_one_line(tmp_path):
    args = TINY + ["--optimizers", "dion3", "--out", str(tmp_path)]
    assert train_gpt.main(args + ["--stop-after", "2"]) == 3
    ck = torch.load(tmp_path / "ckpt-dion3.pt", weights_only=False)
    for st in ck["optimizer"]["state"].values():  # damaged, yet a checkpoint: negative second moments
        for key in ("variance", "variance_neuron"):
            if key in st:
                st[key].fill_(-1.0)
    torch.save(ck, tmp_path / "ckpt-dion3.pt")
    with pytest.raises(SystemExit, match="ckpt-dion3.pt cannot be resumed .*; remove it to train that run again"):
        train_gpt.main(args + ["--resume"])


def test_a_checkpoint_with_non_finite_weights_is_refused_not_reported_as_diverged(tmp_path):
    args = TINY + ["--optimizers", "muon", "--out", str(tmp_path)]
    assert train_gpt.main(args + ["--stop-after", "2"]) == 3
    ck = torch.load(tmp_path / "ckpt-muon.pt", weights_only=False)
    next(t for k, t in ck["model"].items() if k.endswith("weight"))[0, 0] = float("nan")
    torch.save(ck, tmp_path / "ckpt-muon.pt")
    with pytest.raises(SystemExit, match=r"ckpt-muon.pt cannot be resumed \(ValueError: the weights hold NaN or Inf"):
        train_gpt.main(args + ["--resume"])


def test_settings_a_run_does_not_use_leave_it_finished(tmp_path):
    # Muon's lr and Dion3's fractions mean nothing to AdamW's run: changing them does not make a
    # finished AdamW run "other settings" (it is not trained again).
    args = TINY + ["--optimizers", "adamw", "--out", str(tmp_path)]
    assert train_gpt.main(args) == 0
    ckpt = (tmp_path / "ckpt-adamw.pt").stat().st_mtime_ns
    assert train_gpt.main(args + ["--resume", "--lr", "0.05", "--fraction", "0.5,0.25"]) == 0
    assert (tmp_path / "ckpt-adamw.pt").stat().st_mtime_ns == ckpt
    with pytest.raises(SystemExit, match="written with other settings"):
        train_gpt.main(args + ["--resume", "--adamw-lr", "0.01"])


def test_one_session_a_folder(tmp_path):
    import fcntl
    with open(tmp_path / ".lock", "w") as held:  # another session holds the folder
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(SystemExit, match="is in use by another session"):
            train_gpt.main(TINY + ["--optimizers", "adamw", "--out", str(tmp_path)])
    assert not list(tmp_path.glob("ckpt-*"))
    assert train_gpt.main(TINY + ["--optimizers", "adamw", "--out", str(tmp_path)]) == 0


def test_a_learning_rate_beyond_float32_is_refused_up_front(tmp_path):
    with pytest.raises(SystemExit, match="run dion3@1e\\+40x would step with lr .* beyond float32's range"):
        train_gpt.main(TINY + ["--optimizers", "adamw,dion3", "--lr-scales", "1,1e40", "--out", str(tmp_path)])
    assert not list(tmp_path.glob("ckpt-*"))


def test_an_adamw_learning_rate_whose_first_step_overflows_is_refused_up_front(tmp_path):
    # torch's AdamW divides its first step's lr by 1 - beta1 = 0.1, and raises where that overflows.
    with pytest.raises(SystemExit, match="run adamw would step with lr 1e\\+38, which torch's AdamW's first step"):
        train_gpt.main(TINY + ["--optimizers", "adamw", "--adamw-lr", "1e38", "--out", str(tmp_path)])
    assert not list(tmp_path.glob("ckpt-*"))


def test_weights_that_turn_non_finite_end_the_run_as_diverged(tmp_path):
    assert train_gpt.main(TINY + ["--optimizers", "adamw", "--steps", "2", "--eval-every", "1", "--adamw-lr", "1e30",
                                  "--out", str(tmp_path)]) == 0
    assert "| adamw | 1e+30 | diverged (step 1" in (tmp_path / "results.md").read_text()
    json.loads((tmp_path / "history.json").read_text())  # no bare NaN


def test_report_only_skips_a_damaged_record(tmp_path, capsys):
    args = TINY + ["--optimizers", "muon,adamw", "--out", str(tmp_path)]
    assert train_gpt.main(args) == 0
    (tmp_path / "run-muon.json").write_text("{ not json")
    assert train_gpt.main(["--report-only", "--out", str(tmp_path)]) == 0
    assert "skipping run-muon.json, which cannot be read" in capsys.readouterr().err
    table = (tmp_path / "results.md").read_text()
    assert "| adamw | 0.003 |" in table and "muon" not in table.split("\n", 1)[0]


def test_runs_that_would_share_a_name_are_refused_up_front(tmp_path):
    with pytest.raises(SystemExit, match="runs dion3-f0.333333 would share a name"):
        train_gpt.main(TINY + ["--optimizers", "dion3", "--fraction", "0.3333331,0.3333332", "--out", str(tmp_path)])
    assert not list(tmp_path.glob("ckpt-*"))


def test_a_diverging_run_ends_as_diverged_and_the_sweep_goes_on(tmp_path):
    # Muon's gradients overflow at lr 1e4 (dion3 raises NonFiniteError); AdamW's loss turns NaN at
    # lr 100. Neither is the best run; the smaller lr of each trains.
    assert train_gpt.main(TINY + ["--optimizers", "muon,adamw", "--lr", "1e4", "--adamw-lr", "100",
                                  "--lr-scales", "1,0.00003", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "results.md").read_text()
    assert "| muon@1x | 1e+04 | diverged (step " in table and "| adamw@1x | 100 | diverged (step " in table
    assert "| **muon@3e-05x** |" in table and "| **adamw@3e-05x** | 0.003 |" in table
    (tmp_path / "results.md").unlink()
    assert train_gpt.main(["--report-only", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "results.md").read_text() == table


def test_a_finished_runs_record_is_written_again_on_resume(tmp_path):
    args = TINY + ["--optimizers", "adamw", "--out", str(tmp_path)]
    assert train_gpt.main(args) == 0
    record = (tmp_path / "run-adamw.json").read_text()
    (tmp_path / "run-adamw.json").unlink()  # as if stopped between the checkpoint and the record
    assert train_gpt.main(args + ["--resume"]) == 0
    assert (tmp_path / "run-adamw.json").read_text() == record


def test_runs_on_other_data_are_neither_resumed_nor_reported_together(tmp_path):
    args = TINY + ["--optimizers", "adamw", "--out", str(tmp_path)]
    assert train_gpt.main(args + ["--stop-after", "2"]) == 3
    ck = torch.load(tmp_path / "ckpt-adamw.pt", weights_only=False)
    ck["corpus"] = "Python 0.0 standard library source, 0.5 MiB (sha256 000000000000), last 5% held out"
    torch.save(ck, tmp_path / "ckpt-adamw.pt")
    with pytest.raises(SystemExit, match="was trained on other data"):
        train_gpt.main(args + ["--resume"])
    (tmp_path / "ckpt-adamw.pt").unlink()
    assert train_gpt.main(args + ["--lr-scales", "1,2"]) == 0
    rec = train_gpt.json.loads((tmp_path / "run-adamw@2x.json").read_text())
    rec["state"]["corpus"] = ck["corpus"]
    (tmp_path / "run-adamw@2x.json").write_text(train_gpt.json.dumps(rec))
    with pytest.raises(SystemExit, match="trained on different data"):
        train_gpt.main(["--report-only", "--out", str(tmp_path)])


def test_too_many_validation_windows_for_the_corpus_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="fewer than --eval-batches x --batch"):
        train_gpt.main(TINY + ["--eval-batches", "4000", "--out", str(tmp_path)])


def test_the_python_corpus_adds_the_installed_packages_in_a_fixed_shuffled_order():
    stdlib, python = train_gpt.source_files("stdlib"), train_gpt.source_files("python")
    assert stdlib == sorted(stdlib)
    assert set(stdlib) <= set(python) and len(python) > len(stdlib)  # pytest itself is installed
    assert python == train_gpt.source_files("python")  # the same order every time
    assert python != sorted(python)  # the held-out tail samples every package, not the last ones
    assert train_gpt.parse_args(["--preset", "gpu-125m", "--device", "cpu"])[2].corpus == "python"
    assert train_gpt.parse_args(["--preset", "cpu"])[2].corpus == "stdlib"
