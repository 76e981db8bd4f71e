"""plots/<dtype>-<causal|noncausal>.png: GFLOP/s against the sequence length, one panel per
head dim, head configuration and thread count, one line per implementation."""

from __future__ import annotations

import math
from pathlib import Path

from .common import DTYPES, IMPLS

STYLES = {"flashcte": dict(color="C3", marker="o", lw=2.2),
          "flashcte-cli": dict(color="C3", ls=":", marker=".", lw=1.0),
          "flashcte-torch": dict(color="C3", ls="--", marker="o", lw=1.0),
          "sgemm": dict(color="k", ls="--", marker="x", lw=1.2),
          "materialized": dict(color="C7", marker="s"), "torch": dict(color="C0", marker="^"),
          "ort-mha": dict(color="C2", marker="v"), "ort-gqa": dict(color="C8", marker="<"),
          "ort-attention": dict(color="C5", marker=">"),
          "openvino": dict(color="C1", marker="D"),
          "ggml-f16": dict(color="C4", marker="P"),
          "ggml-f32": dict(color="C9", marker="*")}


def panel_key(rec: dict) -> tuple:
    p = rec["point"]
    return (p["d"], p["heads"], p["kv_heads"], p["threads"])


def draw_panel(ax, recs: list[dict], key: tuple) -> None:
    """One panel: every implementation's GFLOP/s over S at head dim, heads and threads `key`."""
    d, h, kvh, thr = key
    sel = sorted([r for r in recs if panel_key(r) == key], key=lambda r: r["point"]["s"])
    for impl in IMPLS:
        xs = [r["point"]["s"] for r in sel if r["impls"].get(impl, {}).get("gflops")]
        ys = [r["impls"][impl]["gflops"] for r in sel
              if r["impls"].get(impl, {}).get("gflops")]
        if xs:
            ax.plot(xs, ys, label=impl, **STYLES.get(impl, {}))
    ax.set_xscale("log", base=2)
    sizes = sorted({r["point"]["s"] for r in sel})
    ax.set_xticks(sizes, [str(x) for x in sizes])
    ax.minorticks_off()
    ax.set_xlabel("sequence length (Sq = Skv)")
    ax.set_ylabel("GFLOP/s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"d={d}, heads {h}:{kvh}, {thr} thread{'s' if thr > 1 else ''}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def make_plots(out_dir: Path, records: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pdir = out_dir / "plots"
    pdir.mkdir(parents=True, exist_ok=True)
    for old in pdir.glob("*.png"):
        old.unlink()
    groups = {}
    for rec in records:
        p = rec["point"]
        groups.setdefault((p["dtype"], p["causal"]), []).append(rec)
    for (dtype, causal), recs in sorted(groups.items()):
        panels = sorted({panel_key(r) for r in recs})
        # only panels with at least two sequence lengths make a curve; keep single points too.
        n = len(panels)
        cols = min(n, 2)
        rows = math.ceil(n / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 4.3 * rows), squeeze=False)
        for ax, key in zip(axes.flat, panels):
            draw_panel(ax, recs, key)
        for ax in list(axes.flat)[n:]:
            ax.axis("off")
        fig.suptitle(f"{dtype}, {'causal' if causal else 'non-causal'}: GFLOP/s "
                     f"(4·d·heads·unmasked pairs / time)")
        fig.tight_layout()
        fig.savefig(pdir / f"{DTYPES[dtype]}-{'causal' if causal else 'noncausal'}.png", dpi=90)
        plt.close(fig)
