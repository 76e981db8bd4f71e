"""The written results: results.csv (one row per point and implementation), results.md (machine,
command, limits, the target table, every point's GFLOP/s and ratios, what was not timed, the
cross-checks), raw.jsonl, meta.json; and the target table's ratios."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from .common import DTYPES, IMPLS, best_peer, fmt, point_name, point_short
from .machine import peak_limit
from .points import TARGET_DTYPE_TAGS

CSV_COLUMNS = ["dtype", "causal", "s", "d", "heads", "kv_heads", "threads", "tags", "impl",
               "status", "median_ms", "min_ms", "gflops", "ratio_to_sgemm", "ratio_to_peak",
               "flashcte_over_impl", "max_err_vs_flashcte", "reps", "load_start", "reason",
               "notes"]
NOTE_KEYS = ("simd", "sdpa_backend", "inference_precision", "openblas_core", "m", "ggml",
             "ggml_work_mib", "tolerance")
STATUS_TAGS = {"wrong": "WRONG", "unsupported": "unsup.", "skipped": "skip", "error": "error"}


def write_outputs(out_dir: Path, meta: dict, records: list[dict], args) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "raw.jsonl", "w") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    write_csv(out_dir / "results.csv", meta, records)
    present = [i for i in IMPLS if any(i in rec["impls"] for rec in records)]
    md = md_header(meta)
    md.extend(peak_section(meta.get("peak")))
    md.extend(target_section(meta.get("target")))
    md.extend(points_section(meta, records, present))
    md.extend(cross_check_section(records, present))
    md.append("## Plots\n")
    for png in sorted((out_dir / "plots").glob("*.png")) if (out_dir / "plots").exists() else []:
        md.append(f"![{png.stem}](plots/{png.name})")
    md.append("")
    (out_dir / "results.md").write_text("\n".join(md) + "\n")


def write_csv(path: Path, meta: dict, records: list[dict]) -> None:
    """Long CSV: one row per (point, implementation)."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for rec in records:
            p, impls = rec["point"], rec["impls"]
            sg = impls.get("sgemm", {}).get("gflops")
            fl = impls.get("flashcte", {}).get("gflops")
            for name in [i for i in IMPLS if i in impls]:
                r = impls[name]
                g = r.get("gflops")
                # sgemm and the materialized peer compute in fp32 whatever the point's dtype.
                pk, _ = peak_limit(meta.get("peak"), "float32" if name in ("sgemm", "materialized")
                                   else p["dtype"], p["threads"])
                notes = ";".join(f"{k}={r[k]}" for k in NOTE_KEYS if k in r)
                w.writerow([p["dtype"], p["causal"], p["s"], p["d"], p["heads"], p["kv_heads"],
                            p["threads"], "+".join(p["tags"]), name, r["status"],
                            fmt(r.get("median_ms"), 3) if g else "",
                            fmt(r.get("min_ms"), 3) if g else "", fmt(g, 3) if g else "",
                            fmt(g / sg, 4) if g and sg else "",
                            fmt(g / pk, 4) if g and pk else "",
                            fmt(fl / g, 4) if g and fl and name != "sgemm" else "",
                            f"{r['max_err']:.3g}" if "max_err" in r else "",
                            len(r.get("times_ms", [])), fmt(rec["summary"].get("load_start"), 2),
                            r.get("reason", ""), notes])


def md_header(meta: dict) -> list[str]:
    """results.md's title and the bullets: date, commit, command, machine, versions, peers."""
    md = [f"# flashcte vs peers: {meta['mode']} run\n"] + run_bullets(meta)
    m = meta["machine"]
    sg = meta.get("openblas_sgemm", {})
    md.append(f"* flashcte SIMD target: {meta['versions'].get('flashcte_simd', '?')}; OpenBLAS core "
              f"of the SGEMM roofline: {sg.get('openblas_core', '?')} "
              f"({'OPENBLAS_CORETYPE set by the sgemm command: ' if sg.get('openblas_core_overridden') else ''}"
              f"{sg.get('openblas_core_reason', 'not reported')}); of the materialized peer: "
              f"{meta.get('openblas_materialized_core', '?')} (the environment as it is); "
              f"OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE in the environment: {m['openblas_env']}")
    md.extend(load_version_bullets(meta))
    md.append(f"* Reps: {meta['reps']} interleaved rounds per point (order rotated each round), "
              f"medians; one warm-up per implementation, which is also the cross-check.")
    md.append("* Peers: " + "; ".join(f"{k}: {v}" for k, v in meta["peer_install"].items()))
    md.append("")
    md.append("GFLOP/s = 4·d·heads·(unmasked query-key pairs) / median time (sgemm: 2·n³ for the "
              "square sgemm `flashcte bench` sizes to about the attention's FLOPs). "
              "Ratios: `ours/X` = flashcte GFLOP/s ÷ X's GFLOP/s (= X's time ÷ ours for "
              "attention peers; > 1 means flashcte is faster); `ours/peak` = flashcte GFLOP/s ÷ "
              "the arithmetic limit below for the point's dtype and threads. `—` = not run: see "
              "the notes below the table and results.csv's reason column.\n")
    return md


def run_bullets(meta: dict) -> list[str]:
    """The bullets of every results.md: date, commit, command, machine, CPU flags."""
    md = [f"* Date: {meta['date']}"]
    src = meta["source"]
    how = ("a `git archive` snapshot of that commit" if src.get("source") == "head"
           else "the work tree as it was")
    if src.get("source") == "worktree" and src.get("worktree_dirty"):
        how += " (with uncommitted changes: " + ", ".join(src.get("dirty_files", [])) + ")"
    if src.get("no_build"):
        how += f"; --no-build: existing builds reused (CLI built from {src.get('cli_commit')})"
    md.append(f"* Commit measured: `{src.get('commit', '?')}` ({src.get('commit_subject', '')}), "
              f"built from {how}; the library (src/, include/) last changed in "
              f"{src.get('last_library_commit', '?')}")
    md.append(f"* Command: `{meta['command']}`")
    m = meta["machine"]
    md.append(f"* Machine: {m['cpu_model']}, {m['cpus']} CPUs ({m['cores_per_socket']} cores per "
              f"socket, {m['threads_per_core']} thread per core), {m['memory']} RAM, "
              f"hypervisor {m['hypervisor']}, Linux {m['kernel']}; caches: {m['caches']}")
    md.append(f"* CPU flags (+ present, - absent): {m['flags_summary']}")
    md.append(f"* `grep -o 'avx512[a-z_0-9]*' /proc/cpuinfo | sort -u`: {m['avx512_grep']}")
    return md


def load_version_bullets(meta: dict) -> list[str]:
    """The load average at the start and end of the run, and the versions in the venv."""
    return [f"* Load average (1 min) at start {meta['load_start']}, at end {meta['load_end']}; "
            f"per point in results.csv (column load_start). The machine has 2 cores and was "
            f"shared with other work.",
            "* Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()
                                       if k != "flashcte_simd" and v)]


def peak_section(peak: dict | None) -> list[str]:
    """results.md's table of the arithmetic limits `flashcte bench --impl peak` measured."""
    md = ["## Arithmetic limits (`flashcte bench --impl peak`)\n"]
    if not peak or "lines" not in peak:
        md.append(f"Not measured: {(peak or {}).get('error', 'no peak run')}.\n")
        return md
    md.append(f"`{peak['command']}`, before the points. GFLOP/s of independent back-to-back "
              f"vector instructions per core, median and best of the rounds; ratios use the best "
              f"(noise only lowers a rate).\n")
    md.append("| kind | target | threads | GFLOP/s (median) | GFLOP/s (best) |")
    md.append("| --- | --- | --- | --- | --- |")
    counting, missing = {}, []
    for l in peak["lines"]:
        counting[l["kind"]] = l.get("counting", "")
        if not l.get("available"):
            missing.append(f"{l['kind']}: {l.get('note', 'not available')}")
            continue
        md.append(f"| {l['kind']} | {l['target']} | {l['threads']} | {fmt(l['gflops'])} | "
                  f"{fmt(l['best_gflops'])} |")
    md.append("")
    md.extend(f"* {kind}: {text}" for kind, text in counting.items())
    md.extend(f"* {text}" for text in missing)
    md.append("")
    return md


def target_section(target: list[dict] | None) -> list[str]:
    if not target:
        return []
    md = ["## Target table (issue 3)\n", "2 threads, d=128, Sq=Skv=4096, 8 heads (MHA) unless said.\n",
          "| ratio | value | from |", "| --- | --- | --- |"]
    md.extend(f"| {row['name']} | {row['value']} | {row['from']} |" for row in target)
    md.append("")
    return md


def point_cells(rec: dict, present: list[str], peak: dict | None, notes: dict) -> list[str]:
    """One row of the table of all points; what was not timed goes into `notes`."""
    p, impls = rec["point"], rec["impls"]
    fl = impls.get("flashcte", {}).get("gflops")
    cells = [DTYPES[p["dtype"]], "yes" if p["causal"] else "no", str(p["d"]),
             f"{p['heads']}:{p['kv_heads']}", str(p["threads"]), str(p["s"])]
    for i in present:
        r = impls.get(i)
        if r is None:
            cells.append("")
        elif r.get("gflops"):
            cells.append(fmt(r["gflops"]))
        else:
            cells.append(STATUS_TAGS.get(r["status"], r["status"]))
            notes.setdefault((i, r["status"], r.get("reason", "")), []).append(point_short(p))
    for i in [i for i in present if i != "flashcte"]:
        g = impls.get(i, {}).get("gflops")
        cells.append(fmt(fl / g, 2) if fl and g else "—")
    bp, bg = best_peer(impls)
    cells.append(f"{fl / bg:.2f} ({bp})" if fl and bg else "—")
    pk, _ = peak_limit(peak, p["dtype"], p["threads"])
    cells.append(fmt(fl / pk, 2) if fl and pk else "—")
    return cells


def points_section(meta: dict, records: list[dict], present: list[str]) -> list[str]:
    md = ["## All points\n"]
    head = ["dtype", "causal", "d", "heads", "thr", "S"] + [f"{i} GF/s" for i in present]
    head += [f"ours/{i}" for i in present if i != "flashcte"] + ["ours/best peer", "ours/peak"]
    md.append("| " + " | ".join(head) + " |")
    md.append("|" + "---|" * len(head))
    notes = {}
    for rec in sorted(records, key=lambda r: (r["point"]["dtype"], not r["point"]["causal"],
                                              r["point"]["d"], r["point"]["heads"],
                                              r["point"]["threads"], r["point"]["s"])):
        md.append("| " + " | ".join(point_cells(rec, present, meta.get("peak"), notes)) + " |")
    md.append("")
    if notes:
        md.append("Not timed:\n")
        for (i, status, reason), where in sorted(notes.items()):
            shown = ", ".join(where[:6]) + (f" and {len(where) - 6} more" if len(where) > 6 else "")
            md.append(f"* {i} {status}: {reason} — {shown}")
        md.append("")
    return md


def cross_check_section(records: list[dict], present: list[str]) -> list[str]:
    """The largest cross-check difference of each peer, against its tolerance (tolerance.py),
    and flashcte's against float64."""
    errs = [(rec["point"], i, r["max_err"], r.get("tolerance"))
            for rec in records for i, r in rec["impls"].items()
            if "max_err" in r and i != "flashcte"]
    if not errs:
        return []
    md = ["Largest cross-check difference per peer (max |peer − flashcte| over the whole output; "
          "tolerance: flashcte's bound against float64 plus the peer's, each derived at the point "
          "as tests/test_util.cc derives its own: twice the error of a plain implementation in "
          "the dtype plus a floor (one rounding of the largest output; fp32: 1e-5 of it), on "
          "sampled rows; a peer that rounds its inputs to a coarser type gets that type's bound, "
          "ggml-f16 fp16's):\n"]
    for i in present:
        e = [x for x in errs if x[1] == i]
        if e:
            p, _, v, t = max(e, key=lambda x: x[2] / x[3] if x[3] else x[2])
            md.append(f"* {i}: {v:.2g}, tolerance {f'{t:.2g}' if t else '—'} ({point_name(p)})")
    md.append("")
    fr = [(s["flashcte_vs_float64"], s.get("flashcte_tolerance"))
          for s in (rec["summary"] for rec in records) if s.get("flashcte_vs_float64") is not None]
    if fr:
        worst = max(fr, key=lambda x: x[0] / x[1] if x[1] else x[0])
        tol = f", tolerance {worst[1]:.2g}" if worst[1] else ""
        md.append(f"flashcte against a float64 reference (sampled query rows of every head, each "
                  f"point's own inputs): worst {worst[0]:.2g}{tol}.\n")
    return md


def div(a, b):
    return a / b if a is not None and b else None


class TargetTable:
    """The target table's rows, built from the records by the points' tags."""

    def __init__(self, records: list[dict], peak: dict | None):
        self.by_tag = {tag: rec for rec in records for tag in rec["point"]["tags"]}
        self.peak, self.rows = peak, []

    def g(self, tag, impl="flashcte"):
        return self.by_tag.get(tag, {}).get("impls", {}).get(impl, {}).get("gflops")

    def ms(self, tag, impl="flashcte"):
        return self.by_tag.get(tag, {}).get("impls", {}).get(impl, {}).get("median_ms")

    def load(self, tag):
        return self.by_tag.get(tag, {}).get("summary", {}).get("load_start")

    def add(self, name, value, frm, nd=2):
        self.rows.append({"name": name, "value": fmt(value, nd) if value is not None else "—",
                          "raw": value, "from": frm})

    def ratio(self, name, a: tuple, b: tuple):
        """Row name: GFLOP/s of (tag, impl) a over b."""
        ga, gb = self.g(*a), self.g(*b)
        self.add(name, div(ga, gb), f"{fmt(ga)} / {fmt(gb)} GFLOP/s")

    def vs_peak(self, name, tag, impl="flashcte"):
        rec = self.by_tag.get(tag)
        if rec is None:
            self.add(name, None, "point not run")
            return
        p = rec["point"]
        dtype = "float32" if impl in ("sgemm", "materialized") else p["dtype"]
        pk, what = peak_limit(self.peak, dtype, p["threads"])
        self.add(name, div(self.g(tag, impl), pk),
                 f"{fmt(self.g(tag, impl))} / {fmt(pk)} GFLOP/s ({what})" if pk else what)


def own_rows(t: TargetTable) -> None:
    """flashcte against the roofline, the arithmetic limits and itself."""
    t.ratio("fp32 non-causal / SGEMM (GFLOP/s)", ("fp32-nc",), ("fp32-nc", "sgemm"))
    t.vs_peak("fp32 non-causal / fp32 FMA peak", "fp32-nc")
    t.vs_peak("fp32 causal / fp32 FMA peak", "fp32-c")
    t.vs_peak("bf16 non-causal / best arithmetic peak (fp32 FMA or bf16 dot)", "bf16-nc")
    t.vs_peak("bf16 causal / best arithmetic peak (fp32 FMA or bf16 dot)", "bf16-c")
    t.vs_peak("fp16 non-causal / fp32 FMA peak (fp16 is computed in fp32)", "fp16-nc")
    t.vs_peak("d=64 fp32 non-causal / fp32 FMA peak", "fp32-nc-d64")
    t.vs_peak("1-thread fp32 non-causal / 1-thread fp32 FMA peak", "fp32-nc-1t")
    t.vs_peak("SGEMM roofline / fp32 FMA peak (how close OpenBLAS gets)", "fp32-nc", "sgemm")
    t.ratio("bf16 / our fp32 (non-causal, throughput)", ("bf16-nc",), ("fp32-nc",))
    t.ratio("bf16 / our fp32 (causal, throughput)", ("bf16-c",), ("fp32-c",))
    t.ratio("fp16 / our fp32 (non-causal, throughput)", ("fp16-nc",), ("fp32-nc",))
    t.add("causal time / non-causal time (fp32; ideal ~0.5)",
          div(t.ms("fp32-c"), t.ms("fp32-nc")),
          f"{fmt(t.ms('fp32-c'))} / {fmt(t.ms('fp32-nc'))} ms", 3)
    t.ratio("d=64 fp32 non-causal / SGEMM", ("fp32-nc-d64",), ("fp32-nc-d64", "sgemm"))
    t.ratio("2-thread / 1-thread throughput (fp32 non-causal)", ("fp32-nc",), ("fp32-nc-1t",))
    t.add("32768-token causal / 4096-token causal, per-FLOP rate (fp32)",
          div(t.g("fp32-c-32k"), t.g("fp32-c")),
          f"{fmt(t.g('fp32-c-32k'))} / {fmt(t.g('fp32-c'))} GFLOP/s" if t.g("fp32-c-32k") else
          "not run (needs --target-max-s 32768, as --standard and --full do)")


def peer_rows(t: TargetTable) -> None:
    """ours / each peer, and ours / the best of them, per dtype and mask."""
    for tag, label in TARGET_DTYPE_TAGS:
        t.ratio(f"ours / materialized ({label}; its compute is fp32)", (tag,),
                (tag, "materialized"))
    for tag, label in TARGET_DTYPE_TAGS:
        t.ratio(f"ours / PyTorch SDPA, same dtype ({label})", (tag,), (tag, "torch"))
    for tag, label in (("fp32-nc", "fp32 non-causal"), ("fp32-c", "fp32 causal")):
        for peer in ("openvino", "ort-mha", "ort-attention", "ggml-f32"):
            t.ratio(f"ours / {peer} ({label})", (tag,), (tag, peer))
    for tag, label in TARGET_DTYPE_TAGS:
        t.ratio(f"ours / ggml-f16, llama.cpp's f16 KV ({label})", (tag,), (tag, "ggml-f16"))
    for tag, label in TARGET_DTYPE_TAGS:
        bp, bg = best_peer(t.by_tag.get(tag, {}).get("impls", {}))
        t.add(f"ours / best of the peers ({label})", div(t.g(tag), bg),
              f"{fmt(t.g(tag))} / {fmt(bg)} GFLOP/s ({bp})" if bp else "no peer timed")


def target_table(records: list[dict], mem: dict, peak: dict | None = None) -> list[dict]:
    t = TargetTable(records, peak)
    own_rows(t)
    peer_rows(t)
    for key, val in mem.items():
        t.rows.append({"name": key, "value": val["value"], "raw": val.get("raw"),
                       "from": val["from"]})
    loads = sorted({fmt(t.load(tag), 2) for tag in t.by_tag
                    if tag != "sweep" and t.load(tag) is not None})
    t.rows.append({"name": "load average (1 min) at the target points", "value": ", ".join(loads),
                   "raw": None, "from": "os.getloadavg() when each point started"})
    return t.rows
