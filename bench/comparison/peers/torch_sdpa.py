"""PyTorch's scaled_dot_product_attention on the CPU."""

from __future__ import annotations

from .base import PyImpl, check_budget


class TorchImpl(PyImpl):
    def setup(self):
        import torch
        import torch.nn.functional as F
        self.torch, self.F = torch, F
        torch.set_num_threads(self.p["threads"])
        tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16,
               "float16": torch.float16}[self.p["dtype"]]
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

    def backend(self) -> str:
        """Which SDPA backend torch picks for these inputs (0 math, 1 flash, ...)."""
        try:
            from torch.nn.attention import SDPBackend
            choice = self.torch._fused_sdp_choice(self.q, self.k, self.v, None, 0.0,
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
