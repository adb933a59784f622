# python -m dion3 — what this installation of dion3 is: version, the backends it was built with
# (and for which GPU architectures), the PyTorch it was built against and the one it runs with.
import argparse
import sys

import torch

import dion3


def main(argv=None):
    argparse.ArgumentParser(
        prog="python -m dion3",
        description="What this installation of dion3 is: its version, the backends it was built with (and for "
                    "which GPU architectures), the PyTorch it was built against and the one it runs with.").parse_args(argv)
    print(f"dion3 {dion3.__version__} ({dion3.__file__})")
    try:
        from dion3 import _build_info as info
    except ImportError:
        print("build: no _build_info (not installed by setup.py's build)")
        info = None
    built_cuda = dion3.cuda_built()
    if info is not None:
        backends = ", ".join(info.BACKENDS)
        archs = f" (architectures {info.CUDA_ARCHS})" if info.CUDA_ARCHS else ""
        print(f"backends: {backends}{archs}; {info.CUDA_REASON}")
        cuda = f", CUDA {info.TORCH_CUDA}" if info.TORCH_CUDA else ""
        print(f"built against PyTorch {info.TORCH_VERSION}{cuda}")
    else:
        print(f"backends: cpu{', cuda' if built_cuda else ''}")
    print(f"running with PyTorch {torch.__version__}; "
          f"CUDA backend usable: {built_cuda and torch.cuda.is_available()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
