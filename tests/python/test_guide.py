# test_guide.py — docs/guide.md runs as written: its Python examples, in order, in one namespace
# on the CPU; its C example is an excerpt of a program the suite compiles and runs
# (tests/c/train_lsq.c), verbatim.
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
