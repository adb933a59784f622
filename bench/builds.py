# bench/builds.py — the Python benchmarks' --build NAME=DIR option: time several dion3 builds side
# by side, each installed into a folder (`pip install --target DIR .` of a checkout) and put first
# on PYTHONPATH of the worker processes. Imported by the scripts beside it.
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Dict, List, Optional, Tuple


def add_option(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--build", action="append", default=[], metavar="NAME=DIR",
                    help="a dion3 installed in DIR (repeatable; default: the one importable here)")


def parse(ap: argparse.ArgumentParser, specs: List[str]) -> List[Tuple[str, str]]:
    """(name, folder) per --build, or the installed dion3 as ("installed", "")."""
    builds = [tuple(b.split("=", 1)) for b in specs] or [("installed", "")]
    for b in builds:
        if len(b) != 2 or (b[1] and not os.path.isdir(b[1])):
            ap.error(f"--build {'='.join(b)}: expected NAME=DIR with an existing folder")
    return builds


def run(script: str, folder: str, args: List[str], env: Optional[Dict[str, str]] = None) -> str:
    """`python script args` in a fresh process with the build in `folder` first on PYTHONPATH; its stdout."""
    env = dict(os.environ, **(env or {}))
    if folder:
        env["PYTHONPATH"] = folder + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return subprocess.run([sys.executable, os.path.abspath(script)] + args, env=env, check=True,
                          capture_output=True, text=True).stdout
