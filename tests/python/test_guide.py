# test_guide.py — docs/guide.md runs as written: its Python examples, in order, in one namespace
# on the CPU; its C example is an excerpt of a program the suite compiles and runs
# (tests/c/train_lsq.c), verbatim; docs/algorithm.md states the engine's defaults and coefficients.
import os
import re

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GUIDE = os.path.join(ROOT, "docs", "guide.md")


def blocks(language):
    text = open(GUIDE).read()
    return re.findall(r"```" + language + r"\n(.*?)```", text, flags=re.S)


def test_the_python_examples_run(capsys):
    code = blocks("python")
    assert len(code) >= 6
    namespace = {"__name__": "guide"}
    torch.manual_seed(0)
    for i, block in enumerate(code):
        exec(compile(block, f"docs/guide.md python block {i}", "exec"), namespace)
    out = capsys.readouterr().out
    assert "did you mean 'fraction'?" in out


def test_the_c_example_is_an_excerpt_of_a_tested_program():
    (c,) = blocks("c")
    program = open(os.path.join(ROOT, "tests", "c", "train_lsq.c")).read()
    assert c in program


ALGORITHM = os.path.join(ROOT, "docs", "algorithm.md")


def test_algorithm_page_states_the_engines_defaults_and_coefficients():
    # docs/algorithm.md repeats numbers the engine defines; they must stay the engine's.
    import dion3

    text = open(ALGORITHM).read()
    engine = dion3.optimizer.ENGINE_DEFAULTS
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+?) \|", text, flags=re.M))
    for key in ("lr", "fraction", "mu", "muon_beta2", "weight_decay", "epsilon"):
        assert float(rows[key]) == engine[key], key
    assert rows["adjust_lr"] == f'`"{engine["adjust_lr"]}"`'
    assert rows["flatten"] == str(engine["flatten"])
    assert f"Restarts default to `{{{', '.join(map(str, engine['restarts']))}}}`" in text
    sets = dion3.optimizer.COEFFICIENT_SETS
    for name in ("polar_express", "you"):
        section = text.split(f'- `"{name}"`', 1)[1].split("\n- ", 1)[0].replace("−", "-")
        steps = [tuple(float(x) for x in t.split(",")) for t in re.findall(r"\(([-\d., ]+)\)", section)]
        assert steps == [tuple(s) for s in sets[name]], name
