"""Measures the context-parallel strategies on this machine against docs/distributed.md's model.

    build/python-venv/bin/python bench/distributed.py [--world 2] [--seqlen 8192] [--causal] ...

Spawns ``--world`` ranks (gloo on loopback), each on ``--threads`` OpenMP threads, and times each
strategy on a Llama-3-8B-shaped attention (32 query heads, 8 KV heads, d = 128, bfloat16 by
default), the best of ``--reps`` calls (``--only`` picks strategies by name). Per strategy it
prints the slowest rank's wall time, the bytes each rank handed to gloo for other ranks (counted
by wrapping ``torch.distributed.isend``, ``all_gather`` and ``all_to_all_single``), the loopback
interface's transmitted bytes around the call (``/proc/net/dev``, which also counts any other
loopback traffic on the machine) and the model's prediction

    predicted = compute time + (bytes not overlapped with compute) / B

The compute time is the slowest rank's: while several ranks compute each does R FLOP/s, and a
rank left computing alone does R_alone (the causal contiguous split leaves the last rank alone
for most of its work). R and R_alone are measured first: every rank at once runs a
single-process ``flash_attn_func`` (same threads, heads and dtype, non-causal, its share of the
queries against the whole sequence) and R is the slowest rank's rate, so the prediction accounts
for the ranks, and any other load on the machine, sharing the cores; R_alone is rank 0 running
it with the other ranks idle. B is the loopback bandwidth of one gloo send of 64 MiB. The
all-gather and Ulysses strategies communicate before (Ulysses: and after) they compute, so their
bytes count in full; the ring sends the next block while it computes on the current one, and on
loopback a block's transfer is far shorter than its computation, so none of it counts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile
import time


def _lo_bytes() -> tuple[int, int]:
    """(received, transmitted) bytes of the loopback interface."""
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == "lo":
                    fields = rest.split()
                    return int(fields[0]), int(fields[8])
    except OSError:
        pass
    return 0, 0


def _flops(pq, pk, left, right, heads, d):
    """4 d heads times the (query, key) pairs the mask keeps."""
    import numpy as np

    lo = np.zeros(pq.size, np.int64) if left < 0 else np.searchsorted(pk, pq - left, "left")
    hi = np.full(pq.size, pk.size) if right < 0 else np.searchsorted(pk, pq + right, "right")
    return 4.0 * d * heads * float(np.maximum(hi - lo, 0).sum())


def _compute_time(flops, rate, rate_alone):
    """The slowest rank's compute time when ranks that finish free their cores: while two or
    more ranks compute each runs at ``rate`` (measured with all of them computing), the last one
    alone at ``rate_alone``."""
    t, done = 0.0, 0.0
    work = sorted(flops)
    for i, f in enumerate(work):
        t += (f - done) / (rate_alone if i == len(work) - 1 else rate)
        done = f
    return t


def _worker(rank, args, port, outdir):
    import numpy as np
    import torch
    import torch.distributed as dist

    import flashcte
    from flashcte import distributed as fd

    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=args.world,
        timeout=datetime.timedelta(seconds=600),
    )
    p = args.world
    sent = {"bytes": 0}
    isend, all_gather, all_to_all_single = dist.isend, dist.all_gather, dist.all_to_all_single

    def counting_isend(tensor, *a, **kw):
        sent["bytes"] += tensor.numel() * tensor.element_size()
        return isend(tensor, *a, **kw)

    def counting_all_gather(outputs, tensor, *a, **kw):
        # gloo's all_gather is a ring: each rank forwards P - 1 buffers of this size.
        sent["bytes"] += (p - 1) * tensor.numel() * tensor.element_size()
        return all_gather(outputs, tensor, *a, **kw)

    def counting_all_to_all_single(
        output, tensor, output_split_sizes=None, input_split_sizes=None, *a, **kw
    ):
        # Every split but this rank's own goes to another rank.
        row = tensor.element_size() * (tensor.numel() // max(1, tensor.shape[0]))
        if input_split_sizes is None:
            own = tensor.shape[0] // p
        else:
            own = input_split_sizes[rank]
        sent["bytes"] += (tensor.shape[0] - own) * row
        return all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, *a, **kw)

    dist.isend, dist.all_gather = counting_isend, counting_all_gather
    dist.all_to_all_single = counting_all_to_all_single
    dtype = getattr(torch, args.dtype)
    s, h, hk, d = args.seqlen, args.heads, args.kv_heads, args.dim
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, s, h, d, generator=g).to(dtype)
    k = torch.randn(1, s, hk, d, generator=g).to(dtype)
    v = torch.randn(1, s, hk, d, generator=g).to(dtype)
    report: dict = {"rank": rank}

    # R: one rank's non-causal rows against the whole sequence, on rank 0 alone on the machine
    # (rate_alone) and on every rank at once (rate: what each rank gets while all compute).
    rows = s // p
    flashcte.flash_attn_func(q[:, :256], k, v, num_threads=args.threads)
    dist.barrier()
    if rank == 0:
        t0 = time.perf_counter()
        flashcte.flash_attn_func(q[:, :rows], k, v, num_threads=args.threads)
        report["rate_alone"] = 4.0 * d * h * rows * s / (time.perf_counter() - t0)
    dist.barrier()
    t0 = time.perf_counter()
    flashcte.flash_attn_func(q[:, rank * rows : (rank + 1) * rows], k, v, num_threads=args.threads)
    report["rate"] = 4.0 * d * h * rows * s / (time.perf_counter() - t0)
    # B: one gloo send of 64 MiB from rank 0 to rank 1.
    buf = torch.zeros(64 << 20, dtype=torch.uint8)
    dist.barrier()
    t0 = time.perf_counter()
    if rank == 0:
        isend(buf, 1).wait()
    elif rank == 1:
        dist.irecv(buf, 0).wait()
    dist.barrier()
    report["bandwidth"] = buf.numel() / (time.perf_counter() - t0)

    left, right = (-1, 0) if args.causal else (-1, -1)
    x = lambda t, layout: fd.shard(t, rank, p, layout)
    # attention_cte's layout for cp_attention_cte: heads folded into bs (query head h reads KV
    # head h // (heads / kv_heads), FlashAttention's GQA grouping), k as (bs_kv, d, S).
    strategies = {
        "all-gather, strided (cp_attention_cte, the Neuron way)": (
            "strided",
            False,
            lambda a, b, c: fd.cp_attention_cte(
                a[0].transpose(0, 1),
                b[0].permute(1, 2, 0),
                c[0].transpose(0, 1),
                scale=d**-0.5,
                causal_mask=args.causal,
                strided=True,
                num_threads=args.threads,
            ),
        ),
        "ring, contiguous (ring_flash_attn_func)": (
            "contiguous",
            True,
            lambda a, b, c: fd.ring_flash_attn_func(
                a, b, c, causal=args.causal, num_threads=args.threads
            ),
        ),
        "ring, zigzag (zigzag_ring_flash_attn_func)": (
            "zigzag",
            True,
            lambda a, b, c: fd.zigzag_ring_flash_attn_func(
                a, b, c, causal=args.causal, num_threads=args.threads
            ),
        ),
        "Ulysses, contiguous (ulysses_flash_attn_func)": (
            "contiguous",
            False,
            lambda a, b, c: fd.ulysses_flash_attn_func(
                a, b, c, causal=args.causal, num_threads=args.threads
            ),
        ),
    }
    if args.only:
        strategies = {n: v for n, v in strategies.items() if args.only.lower() in n.lower()}
    results = []
    for name, (layout, overlapped, fn) in strategies.items():
        ql, kl, vl = x(q, layout), x(k, layout), x(v, layout)
        lengths = fd.split_lengths(s, p, layout)
        pos = [fd.positions(lengths, r, layout) for r in range(p)]
        whole = np.arange(s, dtype=np.int64)
        if name.startswith("Ulysses"):  # every rank: heads / P heads of the whole sequence
            flops = [_flops(whole, whole, left, right, h // p, d) for r in range(p)]
        else:
            flops = [_flops(pos[r], whole, left, right, h, d) for r in range(p)]
        best = None
        for _ in range(args.reps):
            dist.barrier()
            lo0 = _lo_bytes()
            sent["bytes"] = 0
            t0 = time.perf_counter()
            fn(ql, kl, vl)
            dt = time.perf_counter() - t0
            dist.barrier()
            lo1 = _lo_bytes()
            if best is None or dt < best["seconds"]:
                best = {
                    "seconds": dt,
                    "sent": sent["bytes"],
                    "lo_tx": lo1[1] - lo0[1],
                }
        results.append({"name": name, "overlapped": overlapped, "flops": flops, **best})
    report["results"] = results
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="OpenMP threads per rank")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument(
        "--only", default="", help="run only the strategies whose name contains this (e.g. ulysses)"
    )
    args = ap.parse_args(argv)
    if args.world < 2:
        ap.error("--world must be >= 2")

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    outdir = tempfile.mkdtemp(prefix="flashcte-dist-bench-")
    load = os.getloadavg()
    mp.start_processes(_worker, args=(args, port, outdir), nprocs=args.world, start_method="spawn")
    reports = []
    for r in range(args.world):
        with open(os.path.join(outdir, f"rank{r}.json")) as f:
            reports.append(json.load(f))
    rate = min(rep["rate"] for rep in reports)
    rate_alone, bandwidth = reports[0]["rate_alone"], reports[0]["bandwidth"]
    p, s = args.world, args.seqlen
    print(
        f"P={p} S={s} heads {args.heads}/{args.kv_heads} d={args.dim} {args.dtype} "
        f"{'causal' if args.causal else 'non-causal'}, {args.threads} thread(s) per rank; "
        f"load average before {load[0]:.2f}"
    )
    print(
        f"R (per rank, all ranks computing at once; the prediction's) = {rate / 1e9:.1f} "
        f"GFLOP/s; one rank alone {rate_alone / 1e9:.1f} GFLOP/s; loopback gloo B = "
        f"{bandwidth / 1e9:.2f} GB/s"
    )
    print(
        "| strategy | wall s (slowest rank) | predicted s | bytes sent per rank | "
        "loopback tx bytes (all ranks) | FLOPs per rank |"
    )
    print("|---|---|---|---|---|---|")
    for i, res in enumerate(reports[0]["results"]):
        wall = max(rep["results"][i]["seconds"] for rep in reports)
        sent = [rep["results"][i]["sent"] for rep in reports]
        flops = res["flops"]
        comm = max(sent) / bandwidth
        predicted = _compute_time(flops, rate, rate_alone) + (0.0 if res["overlapped"] else comm)
        print(
            f"| {res['name']} | {wall:.2f} | {predicted:.2f} | "
            f"{' / '.join(f'{b / 2**20:.1f} MiB' for b in sent)} | "
            f"{res['lo_tx'] / 2**20:.1f} MiB | "
            f"{' / '.join(f'{f / 1e9:.0f} G' for f in flops)} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
