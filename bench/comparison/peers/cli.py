"""The implementations the flashcte CLI times: sgemm (the roofline), materialized and flashcte
itself (`flashcte bench --impl sgemm|materialized|flashcte`), and the decode kernel (`flashcte
bench --decode`), each call in a fresh process."""

from __future__ import annotations

import json
import subprocess

from ..common import CLI_NAMES


def fresh_process(cmd: list[str]) -> list[str]:
    """Runs cmd as a grandchild forked from a small shell. Linux carries a process's peak RSS
    (ru_maxrss) across fork+exec from a large parent (this worker holds torch, ORT and
    OpenVINO), so the CLI's peak_rss_mib would report ours; a child of `sh` starts clean."""
    return ["sh", "-c", '"$@" & wait $!', "sh", *cmd]


def bench_command(cli: str, p: dict, impl: str, s: int | None = None) -> list[str]:
    """`flashcte bench --reps 1 --json` of point p (at sequence length s if given)."""
    s = p["s"] if s is None else s
    return [cli, "bench", "--sq", str(s), "--skv", str(s), "--d", str(p["d"]),
            "--heads", str(p["heads"]), "--kv-heads", str(p["kv_heads"]),
            "--causal", "true" if p["causal"] else "false", "--dtype", p["dtype"],
            "--threads", str(p["threads"]), "--reps", "1", "--json", "--impl", impl]


def last_json(stdout: str) -> dict:
    return json.loads([l for l in stdout.splitlines() if l.startswith("{")][-1])


def decode_command(cli: str, p: dict, reps: int) -> list[str]:
    """`flashcte bench --decode --json` of decode point p (decode.py), --reps calls, each after a
    timed streaming pass that evicts the caches (--cold, the default)."""
    # With a block size the CLI times the paged call too, interleaved with the dense one; its
    # last JSON line (cli_json's) is the paged call's.
    paged = ["--block-size", str(p["block_size"])] if p.get("block_size") else []
    kv8 = ["--kv-dtype", p["kv_dtype"]] if p.get("kv_dtype") else []
    return [cli, "bench", "--decode", "--batch", str(p["batch"]), "--heads", str(p["heads"]),
            "--kv-heads", str(p["kv_heads"]), "--d", str(p["d"]), "--cached", str(p["cached"]),
            "--new", str(p["new"]), "--dtype", p["dtype"], "--threads", str(p["threads"]),
            "--reps", str(reps), *paged, *kv8, "--json"]


def cli_json(cmd: list[str], timeout: float) -> dict:
    """The last JSON line of cmd, run in a fresh process; raises if it fails."""
    r = subprocess.run(fresh_process(cmd), text=True, capture_output=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip()[-300:]}")
    return last_json(r.stdout)


def cli_run(p: dict, impl: str) -> dict:
    """One `flashcte bench --reps 1` call of implementation `impl` (common.CLI_IMPLS): set-up,
    warm-up, one timed call."""
    # sgemm picks its OpenBLAS kernels itself (`--openblas-core auto`, the default for sgemm).
    return cli_json(bench_command(p["cli"], p, CLI_NAMES[impl]), p["timeout"])
