"""What every implementation timed in the worker's Python process shares."""

from __future__ import annotations


class Unsupported(Exception):
    pass


class Skipped(Exception):
    pass


class PyImpl:
    """An implementation timed in this process. run() returns its output (kept in its
    framework's type); as_numpy() turns it into (heads, S, d) float32 for the cross-check."""

    # A peer that rounds its inputs to a coarser type than the point's names it here (a dtype
    # name): its cross-check is held to that type's tolerance too (tolerance.py).
    rounds_inputs_to: str | None = None

    def __init__(self, name, p, data):
        self.name, self.p, self.data = name, p, data
        self.extra = {}

    def setup(self):
        pass

    def run(self):
        raise NotImplementedError

    def as_numpy(self, out):
        raise NotImplementedError


def np_dtype(name):
    import numpy as np
    if name == "bfloat16":
        import ml_dtypes
        return ml_dtypes.bfloat16
    return {"float32": np.float32, "float16": np.float16}[name]


def check_budget(need: float, p: dict, what: str) -> None:
    """Skips an implementation whose kernel would hold more than --mem-budget-gib (`need`
    bytes); `what` says what it would hold, with {gib} where the GiB go."""
    if need > p["mem_budget"]:
        raise Skipped(f"{what.format(gib=need / 2**30)} (> --mem-budget-gib)")
