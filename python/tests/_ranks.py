"""Real ranks for the distributed tests: `world` spawned processes on this machine in one gloo
process group over loopback, one spawn per test module (a process that imports torch takes
seconds to start).

A module using it defines ``CASES = {name: (case, sizes)}``: each ``case(rank, p, group)`` runs on
the first ``p`` ranks for every ``p`` in ``sizes``, on a group of those ranks (``None``, the
world, when ``p`` is the world size), and raises to fail. Optionally ``_absent_rank(rank,
group)``: run last on ranks 0 and 1 over a group of their own, for the case where a peer never
arrives (its timed-out operation may still be pending inside gloo, so the ranks end with
``os._exit`` and skip the process group's teardown). Each rank writes what raised to a JSON file;
:func:`spawn` merges them into ``{key: {rank: {"error": traceback or None, "seconds": s}}}`` with
keys ``"name[p]"`` and :data:`TIMEOUT_CASE`, which :func:`check` turns into one test each.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import socket
import sys
import tempfile
import time
import traceback

import pytest

TIMEOUT_CASE = "error_absent_rank_times_out"


def case_keys(cases: dict, absent_rank: bool) -> list[str]:
    """The keys :func:`spawn` reports for a module's ``CASES`` (and its ``_absent_rank``)."""
    keys = [f"{name}[{p}]" for name, (_, sizes) in cases.items() for p in sizes]
    return keys + [TIMEOUT_CASE] if absent_rank else keys


def _run(results: dict, key: str, call) -> None:
    t0 = time.monotonic()
    try:
        call()
        results[key] = {"error": None, "seconds": time.monotonic() - t0}
    except BaseException:  # noqa: BLE001 - reported to the parent
        results[key] = {"error": traceback.format_exc(), "seconds": 0}


def _rank_main(rank: int, world: int, port: int, outdir: str, module_name: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    results: dict = {}
    try:
        module = importlib.import_module(module_name)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=60),
        )
        # Every rank creates the same groups in the same order (new_group is collective).
        sizes = sorted({p for _, ps in module.CASES.values() for p in ps if p < world})
        groups = {p: dist.new_group(list(range(p))) for p in sizes}
        groups[world] = None
        absent = getattr(module, "_absent_rank", None)
        absent_group = dist.new_group([0, 1]) if absent else None
        for name, (case, ps) in module.CASES.items():
            for p in ps:
                if rank < p:
                    _run(results, f"{name}[{p}]", lambda c=case, p=p: c(rank, p, groups[p]))
        if absent and rank < 2:
            _run(results, TIMEOUT_CASE, lambda: absent(rank, absent_group))
    except BaseException:  # noqa: BLE001
        results["setup"] = {"error": traceback.format_exc()}
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    sys.stdout.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(module_name: str, world: int, deadline_s: float) -> dict:
    """Runs ``module_name``'s cases on ``world`` spawned ranks (one OpenMP thread each) and
    returns their merged results; fails the test if they take longer than ``deadline_s``."""
    mp = pytest.importorskip("torch.multiprocessing")
    outdir = tempfile.mkdtemp(prefix="flashcte-ranks-")
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        ctx = mp.start_processes(
            _rank_main,
            args=(world, _free_port(), outdir, module_name),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    deadline = time.monotonic() + deadline_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"the {world} ranks did not finish within {deadline_s:.0f} s")
    merged: dict = {}
    for rank in range(world):
        path = os.path.join(outdir, f"rank{rank}.json")
        if not os.path.exists(path):
            pytest.fail(f"rank {rank} wrote no results")
        with open(path) as f:
            for key, value in json.load(f).items():
                merged.setdefault(key, {})[rank] = value
    if os.environ.get("FLASHCTE_DIST_TIMES"):
        for key, ranks in merged.items():
            seconds = max(v.get("seconds", 0) for v in ranks.values())
            print(f"{key}: {seconds:.2f} s", file=sys.stderr)
    return merged


def raises(exc_type, call, *needles) -> None:
    """call() raises exc_type with every needle in its message (the same on every rank)."""
    with pytest.raises(exc_type) as info:
        call()
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"


def raises_in_time(call, *needles, limit_s: float = 15.0) -> None:
    """The absent-rank case: call() gives up with a RuntimeError naming needles, in limit_s."""
    t0 = time.monotonic()
    raises(RuntimeError, call, *needles)
    elapsed = time.monotonic() - t0
    assert elapsed < limit_s, f"took {elapsed:.1f} s"


def check(results: dict, key: str) -> None:
    """One case's test: no rank failed, and every rank it was meant for ran it."""
    assert "setup" not in results, results["setup"]
    assert key in results, f"no rank ran {key}"
    failed = {r: v["error"] for r, v in results[key].items() if v["error"]}
    assert not failed, "\n".join(f"--- rank {r}:\n{e}" for r, e in failed.items())
    if key != TIMEOUT_CASE:
        p = int(key[key.rindex("[") + 1 : -1])
        assert sorted(results[key]) == list(range(p)), (
            f"ranks that ran {key}: {sorted(results[key])}"
        )
