"""The worker: one point, every implementation, in a fresh process (`bench/compare --worker
JSON`). Prints one JSON object per implementation and a summary line."""

from __future__ import annotations

import json
import math
import os
import time

import numpy as np

from .common import CLI_IMPLS, OPENBLAS_FIELDS, attention_flops, median
from .memory import reset_peak_rss, vm_kib
from .peers import PY_IMPLS, Skipped, Unsupported
from .peers.cli import cli_run
from .points import point_inputs
from .tolerance import Yardstick


def emit(obj) -> None:
    print(json.dumps(obj), flush=True)


def cli_ready(p: dict, name: str, res: dict) -> bool:
    """Whether sgemm / materialized can run at this point (else res says why not)."""
    S = p["s"]
    if name == "materialized" and S > p["materialized_max_s"]:
        res.update(status="skipped", reason=f"S > {p['materialized_max_s']} (its S^2 "
                   f"score matrix would be {4 * S * S / 2**30:.1f} GiB)")
        return False
    if not p["cli"]:
        res.update(status="skipped", reason="no flashcte CLI")
        return False
    return True


def warm_up(impl, res: dict, out_bytes: int) -> np.ndarray:
    """The first call: its time and the peak memory it adds; returns its output as numpy."""
    reset_peak_rss()
    base = vm_kib("VmRSS")
    t0 = time.perf_counter()
    out = impl.run()
    res["warmup_ms"] = (time.perf_counter() - t0) * 1e3
    res["extra_mib_first_call"] = max(0.0, (vm_kib("VmHWM") - base) / 1024 - out_bytes / 2**20)
    arr = impl.as_numpy(out)
    del out
    return arr


def cross_check(impl, arr, res: dict, check: dict, summary: dict) -> bool:
    """flashcte against float64 on the sampled rows; a peer against flashcte's output, with the
    tolerances tolerance.py derives. False: not to be timed (res says why)."""
    ys = check["yardstick"]
    if impl.name == "flashcte":
        err, tol = ys.error(arr), ys.bound(impl.p["dtype"])
        summary.update(flashcte_vs_float64=err, flashcte_tolerance=tol, ok=err <= tol,
                       rows_checked=len(ys.rows))
        check["flashcte"] = arr
        res["max_err"] = 0.0
        return True
    ref = check.get("flashcte")
    if ref is None:
        res.update(status="skipped", reason="no flashcte output to check against")
        return False
    err = float(np.max(np.abs(arr - ref)))
    tol = ys.peer_tolerance(impl.rounds_inputs_to)
    res["max_err"], res["tolerance"] = err, tol
    if not np.isfinite(err) or err > tol:
        res.update(status="wrong", reason=f"max |peer − flashcte| = {err:.3g} > {tol:.3g} "
                   f"(tests/test_util.cc's rule at this point); not timed")
        return False
    return True


def set_up(name: str, p: dict, data: tuple, res: dict, check: dict, summary: dict):
    """Sets a Python implementation up, runs it once and cross-checks it. Returns it when it is
    to be timed, else None (res says why)."""
    try:
        impl = PY_IMPLS[name](name, p, data)
        impl.setup()
        res.update(impl.extra)
        arr = warm_up(impl, res, data[0].nbytes)
        return impl if cross_check(impl, arr, res, check, summary) else None
    except Unsupported as e:
        res.update(status="unsupported", reason=str(e))
    except Skipped as e:
        res.update(status="skipped", reason=str(e))
    except MemoryError as e:
        res.update(status="error", reason=f"MemoryError: {e}")
    except Exception as e:  # noqa: BLE001 - a peer's failure must not stop the run
        msg = str(e).strip().splitlines()
        res.update(status="error", reason=f"{type(e).__name__}: {msg[0][:200] if msg else ''}")
    return None


def time_once(p: dict, name: str, res: dict, py: dict) -> None:
    if name in CLI_IMPLS:
        j = cli_run(p, name)
        res["times_ms"].append(j["median_ms"])
        res["cli_flops"] = j["flops"]
        res["peak_rss_mib"] = j["peak_rss_mib"]
        for key in ("m",) + OPENBLAS_FIELDS:
            if key in j:
                res[key] = j[key]
    else:
        t0 = time.perf_counter()
        out = py[name].run()
        res["times_ms"].append((time.perf_counter() - t0) * 1e3)
        del out


def rotated_rounds(reps: int, order: list, results: dict, time_one) -> None:
    """time_one(name, results[name]) for every implementation in `order` once per round, the
    order rotated round by round; one that raises is marked an error and not run again."""
    for r in range(reps):
        k = r % len(order) if order else 0
        for name in order[k:] + order[:k]:
            res = results[name]
            if res["status"] != "ok":
                continue
            time.sleep(0.15)  # let the previous one's spinning workers go idle
            try:
                time_one(name, res)
            except Exception as e:  # noqa: BLE001
                res.update(status="error", reason=f"{type(e).__name__}: {str(e)[:300]}")


def timed_rounds(p: dict, order: list, results: dict, py: dict) -> None:
    """Every implementation once per round, the order rotated round by round."""
    rotated_rounds(p["reps"], order, results, lambda name, res: time_once(p, name, res, py))


def finish(name: str, res: dict, flops: float) -> None:
    """Medians and GFLOP/s of what was timed."""
    if res["status"] == "ok" and res.get("times_ms"):
        res["median_ms"] = median(res["times_ms"])
        res["min_ms"] = min(res["times_ms"])
        f = res.get("cli_flops", flops) if name == "sgemm" else flops
        res["flops"] = f
        res["gflops"] = f / (res["median_ms"] * 1e-3) * 1e-9


def worker(p: dict) -> None:
    """Runs one point and prints one JSON object per implementation (and a summary line)."""
    p["scale"] = 1.0 / math.sqrt(p["d"])
    flops = attention_flops(p)
    data = point_inputs(p)
    io_bytes = sum(a.nbytes for a in data) + data[0].nbytes
    results = {}
    order = []  # implementations that made it to the timing
    py = {}
    summary = {"kind": "point", "load_start": os.getloadavg()[0], "io_mib": io_bytes / 2**20}
    check = {"yardstick": Yardstick(p, data)}

    for name in p["impls"]:
        res = {"impl": name, "status": "ok", "reason": "", "flops": flops}
        results[name] = res
        if name in CLI_IMPLS:
            if cli_ready(p, name, res):
                res["times_ms"] = []
                order.append(name)
            continue
        if name != "flashcte" and not p["peer_ok"].get(name, True):
            res.update(status="skipped", reason=p["peer_reason"].get(name, "not installed"))
            continue
        impl = set_up(name, p, data, res, check, summary)
        if impl is not None:
            res["times_ms"] = []
            py[name] = impl
            order.append(name)
    check.clear()

    timed_rounds(p, order, results, py)
    summary["load_end"] = os.getloadavg()[0]
    for name in p["impls"]:
        finish(name, results[name], flops)
        emit(results[name])
    emit(summary)
