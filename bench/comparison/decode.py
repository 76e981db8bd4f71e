"""A decode point in a fresh process (`bench/compare --decode-worker JSON`): one new token per
sequence against N cached ones, flashcte's decode kernel against PyTorch SDPA and ggml's flash
attention on the same shapes.

flashcte is timed by its CLI, `flashcte bench --decode --json` (the Python package has no decode
call of its own): each of its calls runs after a timed streaming pass over 8x the L3 that evicts
the caches (--cold), and that pass is its bandwidth sample. The peers are timed the same way in
this process: a warm-up (which is also its cross-check), then calls each after an eviction pass
of the same size. They alternate round by round (the order rotated), CALLS_PER_ROUND calls a
round; a round's figure is the median of its calls and the point's the median of its rounds.

An 8-bit point (kv_dtype int8 / float8_e4m3fn / float8_e5m2) has the cache in that format with
one scale per tensor (the CLI's --kv-dtype): torch holds the same kind of cache and dequantizes
it in every timed call (`codes.to(dtype) * scale`, then SDPA: what a torch user with an 8-bit
cache runs), ggml holds a q8_0 cache (llama.cpp's 8-bit cache: blocks of 32 with an fp16 scale).

The CLI does not write its output, so the cross-check holds each peer's output to the float64
result of the decode call on the values its cache holds (tolerance.DecodeYardstick: torch's
dequantized cache, ggml's f16 / f32 / q8_0 one), within the bound flashcte is held to at a
prefill point; flashcte's decode output is checked against float64 by tests/decode_test.cc and
tests/decode_kv8_test.cc, not here. A peer beyond the bound is not timed, except ggml on a q8_0
cache: its CPU kernel also quantizes q to q8_0 (the vec_dot type of a q8_0 K), an error of its
format the bound does not know; it is timed and its error reported. Prints one JSON object per
implementation and a summary line."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from .common import DECODE_IMPLS, DECODE_PEER_MODULES, DTYPES, KV8_MAX, median
from .peers import GgmlDecodeImpl, TorchDecodeImpl, TorchPagedDecodeImpl
from .peers.cli import cli_json, decode_command
from .worker import rotated_rounds

CALLS_PER_ROUND = 3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes(p: dict) -> int:
    """What flashcte's call must read: K and V of every slot the new token attends (N cached +
    its own), every sequence and KV head (an 8-bit cache one byte each, its two scales aside);
    `flashcte bench --decode`'s kv_bytes."""
    elem = 1 if p.get("kv_dtype") else DTYPE_BYTES[p["dtype"]]
    return p["batch"] * p["kv_heads"] * (p["cached"] + p["new"]) * 2 * p["d"] * elem


def decode_name(p: dict) -> str:
    cache = f" pages={p['block_size']}" if p.get("block_size") else ""
    kv = f" cache={p['kv_dtype']}" if p.get("kv_dtype") else ""
    return (f"{DTYPES[p['dtype']]}{kv} B={p['batch']} N={p['cached']}{cache} heads={p['heads']}:"
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


def quantize_per_tensor(t, fmt: str) -> tuple:
    """An 8-bit cache of `t` with one scale (the CLI's --kv-dtype cache): codes = t / scale
    rounded to the format (int8: to nearest even, within +-127), scale = max |t| / the format's
    largest value. Returns (codes, scale)."""
    import torch
    scale = float(t.float().abs().max()) / KV8_MAX[fmt]
    x = t.float() / scale
    if fmt == "int8":
        return x.round().clamp(-127, 127).to(torch.int8), scale
    return x.to(getattr(torch, fmt)), scale


def make_peer(name: str, p: dict, data: tuple):
    """The peer `name` on the point's float inputs: torch on them (an 8-bit point: quantized per
    tensor, with the scales it dequantizes by), ggml on its own cache of them."""
    if name == "ggml":
        return GgmlDecodeImpl(name, p, data)
    q, k, v = data
    if p.get("kv_dtype"):
        (k, sk), (v, sv) = (quantize_per_tensor(t, p["kv_dtype"]) for t in (k, v))
        data = (q, k, v, (sk, sv))
    paged = p.get("block_size", 0) > 0
    return (TorchPagedDecodeImpl if paged else TorchDecodeImpl)(name, p, data)


def set_up_peer(name: str, p: dict, res: dict):
    """A peer on the point's inputs, run once and cross-checked against float64 on the values its
    cache holds. Returns it when it is to be timed, else None (res says why)."""
    from .tolerance import DecodeYardstick
    if not p["peer_ok"][name]:
        res.update(status="skipped", reason=p["peer_reason"][name])
        return None
    try:
        impl = make_peer(name, p, decode_inputs(p))
        impl.setup()
        res.update(impl.extra)
        t0 = time.perf_counter()
        out = impl.as_numpy(impl.run())
        res["warmup_ms"] = (time.perf_counter() - t0) * 1e3
        ys = DecodeYardstick(p, impl.attended())
        err, tol = ys.error(out), ys.bound(p["dtype"])
        res.update(max_err_vs_float64=err, tolerance=tol)
        if err <= tol:
            return impl
        what = f"max |{name} − float64| = {err:.3g} > {tol:.3g} (tolerance.py's bound here)"
        if name == "ggml" and p.get("kv_dtype"):
            res["notes"] = "; ".join(filter(None, (res.get("notes"), f"{what}: ggml quantizes q "
                                                    "to q8_0 against a q8_0 K; timed")))
            return impl
        res.update(status="wrong", reason=f"{what}; not timed")
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


def peer_round(p: dict, impl, evictor: Evictor, res: dict) -> None:
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


def timed_rounds(p: dict, results: dict, peers: dict) -> None:
    """flashcte and each peer once per round, the order rotated round by round."""
    evictor = Evictor() if peers else None
    order = [n for n in DECODE_IMPLS if results[n]["status"] == "ok"]

    def time_one(name: str, res: dict) -> None:
        if name == "flashcte":
            flashcte_round(p, res)
        else:
            peer_round(p, peers[name], evictor, res)

    rotated_rounds(p["reps"], order, results, time_one)


def decode_worker(p: dict) -> None:
    """Runs one decode point; prints one JSON object per implementation and a summary line."""
    p["scale"] = 1.0 / math.sqrt(p["d"])
    nbytes = kv_bytes(p)
    summary = {"kind": "point", "load_start": os.getloadavg()[0], "kv_bytes": nbytes}
    results = {name: {"impl": name, "status": "ok", "reason": "", "rounds_ms": [],
                      "calls_ms": [], "read_gbps_during": []} for name in DECODE_IMPLS}
    if not p["cli"]:
        results["flashcte"].update(status="skipped", reason="no flashcte CLI")
    peers = {}
    for name in DECODE_PEER_MODULES:
        if name not in p["impls"]:
            results[name].update(status="skipped", reason="not in --impls")
        elif (impl := set_up_peer(name, p, results[name])) is not None:
            peers[name] = impl
    timed_rounds(p, results, peers)
    summary["load_end"] = os.getloadavg()[0]
    for res in results.values():
        if res["status"] == "ok" and res["rounds_ms"]:
            res["median_ms"] = median(res["rounds_ms"])
            # flashcte's bytes for every implementation: what the point's cache needs read.
            res["kv_gbps"] = nbytes / (res["median_ms"] * 1e-3) * 1e-9
        print(json.dumps(res), flush=True)
    print(json.dumps(summary), flush=True)
