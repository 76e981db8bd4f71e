#!/usr/bin/env python3
"""bench/tp_weights.py: the memory a tensor-parallel rank of flashcte.AttentionLayer holds when
built from its own shard of a safetensors checkpoint (AttentionLayer.load_safetensors) against
built from the full weights (set_weights with the whole layer's arrays, which it then shards).

    build/python-venv/bin/python bench/tp_weights.py                 # Llama-3-8B's layer, tp 4
    build/python-venv/bin/python bench/tp_weights.py --tp 2 --file-dtype float32

Each rank is measured in a fresh process: its resident set (/proc/self/status VmRSS) before and
after building the layer (the arrays it was given dropped), and its peak (VmHWM, reset before the
build by /proc/self/clear_refs), over the bytes of the rank's shard in float32, the form the
layer keeps its projections in; and the resident set again after malloc_trim(0), which returns
what the allocator keeps free for reuse, so that what remains is what the process holds. A file's
pages the read touches count in the peak while it is mapped.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile

PREFIX = "model.layers.0.self_attn."


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def one_rank(a) -> dict:
    """In a fresh process: build rank a.rank and report its memory."""
    import numpy as np
    import torch  # noqa: F401  (imported before the baseline: read_shard uses it)
    from safetensors import safe_open

    import flashcte

    layer = flashcte.AttentionLayer(
        a.hidden, a.heads, a.kv_heads, a.head_dim, tp_degree=a.tp, tp_rank=a.rank,
        dtype="bfloat16",
    )
    # What loads once per process (OpenBLAS and its buffers, the modules) goes in the baseline:
    # a tiny layer read the same way first.
    tiny = flashcte.AttentionLayer(16, 2, 1, 8, tp_degree=a.tp, tp_rank=a.rank)
    tiny.set_weights(*(np.zeros(s, np.float32) for s in ((16, 16), (8, 16), (8, 16), (16, 16))))
    del tiny
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = status_kib("VmRSS")
    if a.way == "shard":
        layer.load_safetensors(a.path, PREFIX)
    else:
        with safe_open(a.path, framework="pt") as f:
            full = {k[len(PREFIX) : -len(".weight")]: f.get_tensor(k) for k in f.keys()}
        layer.set_weights(**full)
        del full
    gc.collect()
    after, peak = status_kib("VmRSS"), status_kib("VmHWM")
    # What of it the allocator keeps free for reuse rather than the layer holds.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    trimmed = status_kib("VmRSS")
    q, kv = layer.local_num_heads * a.head_dim, layer.local_num_kv_heads * a.head_dim
    shard_bytes = 4 * a.hidden * (2 * q + 2 * kv)
    assert layer.has_weights
    return {"resident": (after - before) * 1024 / shard_bytes,
            "trimmed": (trimmed - before) * 1024 / shard_bytes,
            "peak": (peak - before) * 1024 / shard_bytes, "shard_mib": shard_bytes / 2**20}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--file-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--way", default="", help=argparse.SUPPRESS)
    p.add_argument("--path", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank >= 0:
        print(json.dumps(one_rank(a)))
        return
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
    dtype = getattr(torch, a.file_dtype)
    shapes = {"q_proj": (q, a.hidden), "k_proj": (kv, a.hidden), "v_proj": (kv, a.hidden),
              "o_proj": (a.hidden, q)}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "layer.safetensors")
        save_file({PREFIX + k + ".weight": (torch.randn(s, generator=g) * 0.02).to(dtype)
                   for k, s in shapes.items()}, path)
        print(f"layer {a.hidden} hidden, {a.heads}/{a.kv_heads} heads of {a.head_dim}, "
              f"{a.file_dtype} file of {os.path.getsize(path) / 2**20:.0f} MiB, tp {a.tp}")
        print("rank  way    shard MiB  resident/shard  after malloc_trim  peak/shard")
        for rank in range(a.tp):
            for way in ("shard", "full"):
                out = subprocess.run(
                    [sys.executable, __file__, "--hidden", str(a.hidden), "--heads",
                     str(a.heads), "--kv-heads", str(a.kv_heads), "--head-dim",
                     str(a.head_dim), "--tp", str(a.tp), "--rank", str(rank), "--way", way,
                     "--path", path], capture_output=True, text=True, check=True).stdout
                r = json.loads(out.strip().splitlines()[-1])
                print(f"{rank:4d}  {way:5s}  {r['shard_mib']:9.1f}  {r['resident']:14.3f}  "
                      f"{r['trimmed']:17.3f}  {r['peak']:10.3f}")


if __name__ == "__main__":
    main()
