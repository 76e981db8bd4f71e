"""PyTorch's scaled_dot_product_attention on the CPU: on a prefill point (TorchImpl) and on a
decode step against a KV cache (TorchDecodeImpl, bench/compare --decode)."""

from __future__ import annotations

from .base import PyImpl, check_budget


def torch_dtype(torch, name: str):
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def has_enable_gqa(torch, F) -> bool:
    """Whether this torch's SDPA takes enable_gqa (2.5 and later)."""
    q, kv = torch.zeros(1, 2, 1, 4), torch.zeros(1, 1, 1, 4)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
        return True
    except TypeError:
        return False


class TorchImpl(PyImpl):
    def setup(self):
        import torch
        import torch.nn.functional as F
        self.torch, self.F = torch, F
        torch.set_num_threads(self.p["threads"])
        tdt = torch_dtype(torch, self.p["dtype"])
        q, k, v = self.data
        # numpy has no bfloat16 torch understands: go through float32 (exact: values are bf16).
        conv = lambda a: torch.from_numpy(a.astype("float32"))[None].to(tdt).contiguous()
        self.q, self.k, self.v = conv(q), conv(k), conv(v)
        self.gqa = self.p["heads"] != self.p["kv_heads"]
        self.extra["torch"] = torch.__version__
        self.extra["sdpa_backend"] = self.backend()
        if self.extra["sdpa_backend"] not in ("FLASH_ATTENTION",):
            check_budget(3 * 4 * self.p["heads"] * self.p["s"] ** 2, self.p,
                         f"torch picks {self.extra['sdpa_backend']} here, which materializes "
                         "~{gib:.0f} GiB of scores")

    def backend(self, k=None, v=None) -> str:
        """Which SDPA backend torch picks for q and these k, v (self's unless given; 0 math,
        1 flash, ...)."""
        k = self.k if k is None else k
        v = self.v if v is None else v
        try:
            from torch.nn.attention import SDPBackend
            choice = self.torch._fused_sdp_choice(self.q, k, v, None, 0.0,
                                                  self.p["causal"], scale=self.p["scale"],
                                                  enable_gqa=self.gqa)
            return SDPBackend(choice).name
        except Exception as e:  # noqa: BLE001 - informational only
            return f"unknown ({type(e).__name__})"

    def run(self):
        with self.torch.inference_mode():
            return self.F.scaled_dot_product_attention(
                self.q, self.k, self.v, is_causal=self.p["causal"], scale=self.p["scale"],
                enable_gqa=self.gqa)

    def as_numpy(self, out):
        return out[0].float().numpy()


class TorchDecodeImpl(TorchImpl):
    """SDPA on a decode step: data = q (B, heads, 1, d) and the cache's k, v (B, kv_heads, N + 1,
    d), torch tensors of the point's dtype; no mask (the new token attends every slot). GQA
    through enable_gqa=True; a torch without it gets K/V repeated to the query heads once, in
    setup (extra["gqa"] says which, and then torch reads heads/kv_heads times the bytes).

    An 8-bit cache: data = (q, k codes, v codes, (k scale, v scale)), int8 or float8 codes with
    one scale each; every call dequantizes them to q's dtype (`codes.to(dtype) * scale`) before
    SDPA, as torch has no attention on 8-bit K/V."""

    def setup(self):
        import torch
        import torch.nn.functional as F
        self.torch, self.F = torch, F
        torch.set_num_threads(self.p["threads"])
        self.q, self.k, self.v = self.data[:3]
        self.scales = self.data[3] if len(self.data) > 3 else None
        if self.scales:
            self.extra["dequantize"] = f"{self.k.dtype} codes .to({self.q.dtype}) * scale, per call"
        heads, kv_heads = self.p["heads"], self.p["kv_heads"]
        self.gqa = heads != kv_heads
        self.extra.update(torch=torch.__version__, gqa="none (heads == kv_heads)")
        if self.gqa and has_enable_gqa(torch, F):
            self.extra["gqa"] = "enable_gqa=True"
        elif self.gqa:
            self.k, self.v = (t.repeat_interleave(heads // kv_heads, dim=1).contiguous()
                              for t in (self.k, self.v))
            self.gqa = False
            self.extra["gqa"] = f"K/V repeated to {heads} heads (this torch has no enable_gqa)"
        with torch.inference_mode():  # SDPA's choice for what it is given: the dequantized K/V
            self.extra["sdpa_backend"] = self.backend(*self.dequantized(self.k, self.v))

    def run(self):
        kw = {"enable_gqa": True} if self.gqa else {}
        with self.torch.inference_mode():
            k, v = self.dequantized(*self.kv())
            return self.F.scaled_dot_product_attention(self.q, k, v, scale=self.p["scale"], **kw)

    def kv(self):
        return self.k, self.v

    def dequantized(self, k, v):
        if not self.scales:
            return k, v
        return tuple(t.to(self.q.dtype).mul_(s) for t, s in zip((k, v), self.scales))

    def attended(self):
        """q, k, v as the values SDPA attends (the cross-check's inputs)."""
        with self.torch.inference_mode():
            return (self.q, *self.dequantized(self.data[1], self.data[2]))

    def as_numpy(self, out):
        return out.float().numpy().reshape(-1, out.shape[2], out.shape[3])


class TorchPagedDecodeImpl(TorchDecodeImpl):
    """The decode step over a paged cache the way transformers' paged cache runs on the CPU: the
    sequences' pages (point["block_size"] slots, vLLM's (num_blocks, kv_heads, block_size, d),
    at shuffled places in the pool) gathered into dense K/V by index_select, then SDPA; the
    gather is part of every timed call."""

    def setup(self):
        import torch
        super().setup()
        B, Hk, L, d = self.k.shape
        block = self.p["block_size"]
        pages = -(-L // block)
        self.L = L
        order = torch.randperm(B * pages, generator=torch.Generator().manual_seed(7))
        self.table = order.view(B, pages)
        pad = pages * block - L
        pools = []
        for t in (self.k, self.v):
            padded = torch.nn.functional.pad(t, (0, 0, 0, pad))  # (B, Hk, pages * block, d)
            paged = padded.view(B, Hk, pages, block, d).permute(0, 2, 1, 3, 4)
            pool = torch.empty((B * pages, Hk, block, d), dtype=t.dtype)
            pool[order] = paged.reshape(B * pages, Hk, block, d)
            pools.append(pool)
        self.pool_k, self.pool_v = pools
        self.extra["paged"] = f"index_select of {block}-slot pages, then SDPA"

    def kv(self):
        B, pages = self.table.shape
        out = []
        for pool in (self.pool_k, self.pool_v):
            g = pool.index_select(0, self.table.reshape(-1))  # (B * pages, Hk, block, d)
            Hk, block, d = g.shape[1:]
            out.append(g.view(B, pages, Hk, block, d).permute(0, 2, 1, 3, 4)
                       .reshape(B, Hk, pages * block, d)[:, :, : self.L])
        return out
