# dion3 — PyTorch front end of the dion3 engine (placeholder while the optimizer module lands).
from . import _C  # noqa: F401
