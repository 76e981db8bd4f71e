"""flashcte itself, through its Python package: the reference of every cross-check."""

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
