# test_recipes.py — docs/recipes.md runs as written: each framework recipe (Hugging Face Trainer,
# PyTorch Lightning, accelerate) is one code block, run on its own on the CPU with a tiny model;
# its asserts check that the optimizer stepped the model.
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEXT = open(os.path.join(ROOT, "docs", "recipes.md")).read()
BLOCKS = re.findall(r"```python\n(.*?)```", TEXT, flags=re.S)
NEEDS = ["transformers", "lightning", "accelerate"]


def test_there_is_one_recipe_per_framework():
    assert len(BLOCKS) == len(NEEDS)
    for block, package in zip(BLOCKS, NEEDS):
        assert f"import {package}" in block or f"from {package} " in block


@pytest.mark.parametrize("index", range(len(NEEDS)), ids=NEEDS)
def test_the_recipe_trains(index):
    pytest.importorskip(NEEDS[index])  # scripts/setup-python.sh installs them
    exec(compile(BLOCKS[index], f"docs/recipes.md recipe {index}", "exec"), {"__name__": "recipe"})
