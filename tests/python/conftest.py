# conftest.py — shared fixtures of the dion3 Python suite: the devices to run on (cpu, plus cuda
# when PyTorch sees a GPU and dion3 was built with CUDA; DION3_REQUIRE_CUDA=1 makes that mandatory).
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests import reference.py directly

import dion3  # noqa: E402

DEVICES = ["cpu"]
if torch.cuda.is_available() and dion3.cuda_built():
    DEVICES.append("cuda")
elif os.environ.get("DION3_REQUIRE_CUDA") == "1":
    # The GPU run sets this so that a build without CUDA cannot pass by skipping every CUDA test.
    raise RuntimeError(f"DION3_REQUIRE_CUDA=1 but torch.cuda.is_available()={torch.cuda.is_available()} "
                       f"and dion3.cuda_built()={dion3.cuda_built()}")


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


def pytest_report_header(config):
    return f"dion3 devices: {', '.join(DEVICES)}; torch {torch.__version__}"
