"""A decode point in a fresh process (`bench/compare --decode-worker JSON`): one new token per
sequence against N cached ones, flashcte's decode kernel against PyTorch SDPA on the same shapes.

flashcte is timed by its CLI, `flashcte bench --decode --json` (the Python package has no decode
call of its own): each of its calls runs after a timed streaming pass over 8x the L3 that evicts
the caches (--cold), and that pass is its bandwidth sample. torch is timed the same way in this
process: a warm-up (which is also its cross-check), then calls each after an eviction pass of the
same size. The two alternate round by round (the order rotated), CALLS_PER_ROUND calls a round;
a round's figure is the median of its calls and the point's the median of its rounds.

The CLI does not write its output, so the cross-check holds torch's output to the float64 result
of the decode call on the point's own inputs (tolerance.DecodeYardstick), within the bound
flashcte is held to at a prefill point; flashcte's decode output is checked against float64 by
tests/decode_test.cc, not here. Prints one JSON object per implementation and a summary line."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from .common import DTYPES, median
from .peers import TorchDecodeImpl, TorchPagedDecodeImpl
from .peers.cli import cli_json, decode_command
from .worker import rotated_rounds

CALLS_PER_ROUND = 3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes(p: dict) -> int:
    """What a call must read: K and V of every slot the new token attends (N cached + its own),
    every sequence and KV head; `flashcte bench --decode`'s kv_bytes."""
    return (p["batch"] * p["kv_heads"] * (p["cached"] + p["new"]) * 2 * p["d"]
            * DTYPE_BYTES[p["dtype"]])


def decode_name(p: dict) -> str:
    cache = f" pages={p['block_size']}" if p.get("block_size") else ""
    return (f"{DTYPES[p['dtype']]} B={p['batch']} N={p['cached']}{cache} heads={p['heads']}:"
            f"{p['kv_heads']} d={p['d']} threads={p['threads']}")


def evict_bytes() -> int:
    """The size of `flashcte bench --decode --cold`'s pass (tools/bandwidth.cc,
    BandwidthBufferBytes): 8x the L3 (sysfs), at least 256 MiB, at most 1 GiB."""
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        unit = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
        l3 = int(text.rstrip("KM")) * unit
    except (OSError, ValueError):
        l3 = 32 << 20
    return min(max(8 * l3, 256 << 20), 1 << 30)


def decode_inputs(p: dict) -> tuple:
    """q (B, heads, 1, d), k and v (B, kv_heads, N + 1, d) laid out as the CLI's cache (the new
    token's K/V in the last slot): standard normal (seeded), rounded to the dtype."""
    import torch
    from .peers.torch_sdpa import torch_dtype
    g = torch.Generator().manual_seed(1234)
    B, L, d = p["batch"], p["cached"] + p["new"], p["d"]
    shapes = ((B, p["heads"], p["new"], d), (B, p["kv_heads"], L, d), (B, p["kv_heads"], L, d))
    return tuple(torch.randn(s, generator=g).to(torch_dtype(torch, p["dtype"])) for s in shapes)


def set_up_torch(p: dict, res: dict):
    """torch on the point's inputs, run once and cross-checked against float64. Returns it when
    it is to be timed, else None (res says why)."""
    from .tolerance import DecodeYardstick
    if not p["torch_ok"]:
        res.update(status="skipped", reason=p["torch_reason"])
        return None
    try:
        data = decode_inputs(p)
        paged = p.get("block_size", 0) > 0
        impl = (TorchPagedDecodeImpl if paged else TorchDecodeImpl)("torch", p, data)
        impl.setup()
        res.update(impl.extra)
        t0 = time.perf_counter()
        out = impl.as_numpy(impl.run())
        res["warmup_ms"] = (time.perf_counter() - t0) * 1e3
        ys = DecodeYardstick(p, data)
        err, tol = ys.error(out), ys.bound(p["dtype"])
        res.update(max_err_vs_float64=err, tolerance=tol)
        if not err <= tol:
            res.update(status="wrong", reason=f"max |torch − float64| = {err:.3g} > {tol:.3g} "
                       f"(tolerance.py's bound at this point); not timed")
            return None
        return impl
    except Exception as e:  # noqa: BLE001 - a peer's failure must not stop the run
        msg = str(e).strip().splitlines()
        res.update(status="error", reason=f"{type(e).__name__}: {msg[0][:200] if msg else ''}")
    return None


class Evictor:
    """The eviction pass before each torch call: a sum over evict_bytes() on the point's
    threads (torch's), as the CLI's pass before each of its calls."""

    def __init__(self):
        import torch
        self.buf = torch.ones(evict_bytes() // 8, dtype=torch.int64)

    def run(self) -> None:
        self.buf.sum()


def flashcte_round(p: dict, res: dict) -> None:
    j = cli_json(decode_command(p["cli"], p, p["calls"]), p["timeout"])
    res["rounds_ms"].append(j["median_ms"])
    res["min_ms"] = min(res.get("min_ms", math.inf), j["min_ms"])
    res["read_gbps_during"].append(j["read_bandwidth_gbps"])
    res.update(simd=j.get("simd"), cli_kv_bytes=j.get("kv_bytes"))


def torch_round(p: dict, impl, evictor: Evictor, res: dict) -> None:
    calls = []
    for _ in range(p["calls"]):
        evictor.run()
        t0 = time.perf_counter()
        out = impl.run()
        calls.append((time.perf_counter() - t0) * 1e3)
        del out
    res["rounds_ms"].append(median(calls))
    res["calls_ms"] += calls
    res["min_ms"] = min(res.get("min_ms", math.inf), min(calls))


def timed_rounds(p: dict, results: dict, torch_impl) -> None:
    """flashcte and torch once per round each, the order rotated round by round."""
    evictor = Evictor() if torch_impl is not None else None
    order = [n for n in ("flashcte", "torch") if results[n]["status"] == "ok"]

    def time_one(name: str, res: dict) -> None:
        if name == "flashcte":
            flashcte_round(p, res)
        else:
            torch_round(p, torch_impl, evictor, res)

    rotated_rounds(p["reps"], order, results, time_one)


def decode_worker(p: dict) -> None:
    """Runs one decode point; prints one JSON object per implementation and a summary line."""
    p["scale"] = 1.0 / math.sqrt(p["d"])
    nbytes = kv_bytes(p)
    summary = {"kind": "point", "load_start": os.getloadavg()[0], "kv_bytes": nbytes}
    results = {name: {"impl": name, "status": "ok", "reason": "", "rounds_ms": [],
                      "calls_ms": [], "read_gbps_during": []} for name in ("flashcte", "torch")}
    if not p["cli"]:
        results["flashcte"].update(status="skipped", reason="no flashcte CLI")
    torch_impl = None
    if "torch" in p["impls"]:
        torch_impl = set_up_torch(p, results["torch"])
    else:
        results["torch"].update(status="skipped", reason="not in --impls")
    timed_rounds(p, results, torch_impl)
    summary["load_end"] = os.getloadavg()[0]
    for res in results.values():
        if res["status"] == "ok" and res["rounds_ms"]:
            res["median_ms"] = median(res["rounds_ms"])
            res["kv_gbps"] = nbytes / (res["median_ms"] * 1e-3) * 1e-9
        print(json.dumps(res), flush=True)
    print(json.dumps(summary), flush=True)
