# conftest.py — shared fixtures of the dion3 Python suite: the devices to run on (cpu, plus cuda
# when PyTorch sees a GPU and dion3 was built with CUDA) and small helpers.
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests import reference.py directly

import dion3  # noqa: E402

DEVICES = ["cpu"]
if torch.cuda.is_available() and dion3.cuda_built():
    DEVICES.append("cuda")


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


def pytest_report_header(config):
    return f"dion3 devices: {', '.join(DEVICES)}; torch {torch.__version__}"
