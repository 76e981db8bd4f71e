"""flashcte itself, through its Python package: the reference of every cross-check (on numpy
arrays as numpy allocates them), and the same call on torch tensors (FlashTorchImpl)."""

from __future__ import annotations

from .base import PyImpl


class FlashImpl(PyImpl):
    def setup(self):
        import numpy as np
        import flashcte
        self.f = flashcte
        q, k, v = self.data
        self.q, self.kt, self.v = q, np.ascontiguousarray(k.transpose(0, 2, 1)), v
        self.extra["simd"] = flashcte.simd_target()

    def run(self):
        p = self.p
        return self.f.attention_cte(self.q, self.kt, self.v, scale=p["scale"],
                                    causal_mask=p["causal"], num_threads=p["threads"])

    def as_numpy(self, out):
        import numpy as np
        return np.asarray(out).astype(np.float32)


class FlashTorchImpl(FlashImpl):
    """flashcte on torch tensors holding the same values (torch's CPU allocator aligns to 64
    bytes; numpy's large arrays start 16 bytes past a line): what a torch user passes."""

    def setup(self):
        import torch
        super().setup()
        dt = {"float32": torch.float32, "bfloat16": torch.bfloat16,
              "float16": torch.float16}[self.p["dtype"]]
        # Through float32 (exact for bf16 / fp16 values): numpy's bfloat16 is not torch's. The
        # clone puts the data in torch's own allocation (a float32 .to() would keep numpy's).
        conv = lambda a: torch.from_numpy(a.astype("float32")).to(dt).clone()
        self.q, self.kt, self.v = conv(self.q), conv(self.kt), conv(self.v)
        self.extra["data_ptr_mod_64"] = [t.data_ptr() % 64 for t in (self.q, self.kt, self.v)]

    def as_numpy(self, out):
        return out.float().numpy()
