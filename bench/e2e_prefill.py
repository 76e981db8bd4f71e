#!/usr/bin/env python3
"""bench/e2e_prefill.py: an end-to-end prefill of a random-weight Llama-shaped transformers model,
attention through flashcte ("attention_cte") against transformers' sdpa, and the share of the time
spent in attention.

    build/python-venv/bin/python bench/e2e_prefill.py                 # 8 layers, hidden 2048,
                                                                      # 16/4 heads, 2048 tokens
    build/python-venv/bin/python bench/e2e_prefill.py --layers 4 --hidden 1024 --tokens 1024
    build/python-venv/bin/python bench/e2e_prefill.py --help

Needs torch, transformers and flashcte in the interpreter (python/run_tests.sh builds such a venv
in build/python-venv). What it does:
  * builds LlamaForCausalLM from a config (random weights, no download) in each --dtypes dtype;
  * registers two timed attention functions with transformers' AttentionInterface, one wrapping
    transformers' own sdpa_attention_forward and one wrapping flashcte's attention_cte_forward
    (both with the sdpa mask builder), so both runs go through the same dispatch and the time
    inside attention is the sum over the layers of each call's wall time;
  * times one forward of a --batch x --tokens prompt (causal prefill from an empty cache, logits
    of the last token only, as generate() does) under torch.inference_mode(): a warm-up per
    implementation, then --reps rounds, each running both implementations in alternating order;
    reports medians (and the best round, for a shared machine): forward time, time in attention,
    its share, prompt tokens per second;
  * checks that the two implementations' last-token logits agree (fp32: 1e-3 of max|logit|).
torch runs its matmuls on torch.get_num_threads() threads, flashcte on OpenMP's default (both
all cores unless --threads or OMP_NUM_THREADS say otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=None, help="default: 8/3 hidden, to 256")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tokens", type=int, default=2048, help="prompt length")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--pad", type=int, default=0,
                   help="left-pad every other sequence by this many tokens (padding-mask path)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch and OpenMP threads")
    p.add_argument("--json", default=None, help="also write the results to this file")
    return p.parse_args(argv)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


class Timed:
    """An attention function that adds each call's wall time to `self.seconds`."""

    def __init__(self, fn):
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        out = self.fn(*args, **kwargs)
        self.seconds += time.perf_counter() - t
        self.calls += 1
        return out


def timed_forward(torch, model, name, timed, ids, mask):
    """One prefill forward with attention implementation `name` (whose function is `timed`):
    (seconds, seconds in attention, attention calls, last-token logits)."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # older transformers (4.51 has no set_attn_implementation)
        model.config._attn_implementation = name
    timed.seconds, timed.calls = 0.0, 0
    t = time.perf_counter()
    with torch.inference_mode():
        try:  # logits of the last token only, as generate() asks for them
            logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits
        except TypeError:  # no logits_to_keep in this transformers
            logits = model(input_ids=ids, attention_mask=mask).logits[:, -1:]
    total = time.perf_counter() - t
    return total, timed.seconds, timed.calls, logits.float()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before flashcte's OpenMP starts
    import torch
    import transformers
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    import flashcte
    import flashcte.integrations.transformers as fct

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:
        sys.exit("bench/e2e_prefill.py needs transformers >= 4.53 (AttentionMaskInterface)")

    impls = {"sdpa": Timed(sdpa_attention_forward),
             "attention_cte": Timed(fct.attention_cte_forward)}
    names = {}
    for impl, fn in impls.items():
        names[impl] = f"bench_{impl}"
        AttentionInterface.register(names[impl], fn)
        AttentionMaskInterface.register(names[impl], ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])

    inter = args.intermediate or 256 * round(args.hidden * 8 / 3 / 256)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=inter,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=max(4096, args.tokens),
        pad_token_id=0)
    head_dim = args.hidden // args.heads
    print(f"# CPU: {cpu_model()} ({os.cpu_count()} CPUs), torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), transformers {transformers.__version__}, "
          f"flashcte {flashcte.__version__} ({flashcte.simd_target()})")
    padding = f", every other row left-padded by {args.pad}" if args.pad else ""
    print(f"# Llama-shaped: {args.layers} layers, hidden {args.hidden}, "
          f"{args.heads}/{args.kv_heads} heads (head_dim {head_dim}), intermediate {inter}, "
          f"vocab {args.vocab}; prompt {args.batch} x {args.tokens} tokens{padding}; "
          f"{args.reps} reps")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, args.vocab, (args.batch, args.tokens), generator=g)
    mask = torch.ones_like(ids)
    if args.pad:
        mask[::2, : args.pad] = 0
        ids[mask == 0] = 0

    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).to(dtype).eval()

        def forward(impl, model=model):
            return timed_forward(torch, model, names[impl], impls[impl], ids, mask)

        results = {impl: [] for impl in impls}
        ref = {impl: forward(impl)[3] for impl in impls}  # warm-up, and the logits
        scale = ref["sdpa"].abs().max().item()
        diff = (ref["attention_cte"] - ref["sdpa"]).abs().max().item()
        order = list(impls)
        for rep in range(args.reps):
            for impl in order if rep % 2 == 0 else order[::-1]:
                total, attn, calls, _ = forward(impl)
                results[impl].append((total, attn))
        print(f"\n## {dtype_name}: last-token logits differ by {diff:.3g} "
              f"(max |logit| {scale:.3g})")
        print("| attention | forward (s) | in attention (s) | attention share | prompt tok/s "
              "| best forward (s) | best attention (s) |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        med = {}
        for impl in impls:
            total = statistics.median(r[0] for r in results[impl])
            attn = statistics.median(r[1] for r in results[impl])
            best_total = min(r[0] for r in results[impl])
            best_attn = min(r[1] for r in results[impl])
            med[impl] = (total, attn)
            tps = args.batch * args.tokens / total
            print(f"| {impl} | {total:.3f} | {attn:.3f} | {100 * attn / total:.1f}% | {tps:.0f} "
                  f"| {best_total:.3f} | {best_attn:.3f} |")
            rows.append({"dtype": dtype_name, "impl": impl, "forward_s": total,
                         "attention_s": attn, "attention_share": attn / total,
                         "tokens_per_s": tps, "best_forward_s": best_total,
                         "best_attention_s": best_attn, "reps": [list(r) for r in results[impl]],
                         "logit_diff": diff, "logit_scale": scale, "calls": calls})
        (ts, as_), (tc, ac) = med["sdpa"], med["attention_cte"]
        print(f"attention_cte vs sdpa: forward x{ts / tc:.2f}, attention x{as_ / ac:.2f} "
              f"(attention {as_:.3f} s -> {ac:.3f} s; the rest {ts - as_:.3f} s vs "
              f"{tc - ac:.3f} s)")
        if dtype == torch.float32 and diff > 1e-3 * scale:
            print(f"error: fp32 logits differ by {diff:.3g} > 1e-3 * {scale:.3g}", file=sys.stderr)
            return 1
        del model
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_model(), "args": vars(args), "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
