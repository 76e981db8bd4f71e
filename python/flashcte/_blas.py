"""Where the attention layer's projections find OpenBLAS on a machine without the system's.

The C++ layer loads the system's libopenblas.so.0 (Debian's libopenblas0) with dlopen on its
first projection; a wheel does not bundle it (nothing links it, so auditwheel never sees it).
Without it, the pip package scipy-openblas32 (``pip install flashcte[blas]``: the OpenBLAS build
that numpy's and scipy's wheels vendor, every symbol prefixed ``scipy_``) is the fallback this
module registers at import. With neither, the layer's calls fail with a ValueError naming both.

The library is found without importing scipy_openblas32: that import loads it at once, before
the layer could pick OpenBLAS's kernels for this CPU (OPENBLAS_CORETYPE, src/layer/blas.h).
"""

import importlib.util
from pathlib import Path
from typing import Optional

from . import _flashcte

# The prefix of scipy-openblas32's symbols (scipy_cblas_sgemm, scipy_openblas_get_corename, ...),
# as its pkg-config file declares it (-DBLAS_SYMBOL_PREFIX=scipy_).
SCIPY_OPENBLAS_PREFIX = "scipy_"


def scipy_openblas_library() -> Optional[str]:
    """The path of scipy-openblas32's shared library, or None when it is not installed."""
    spec = importlib.util.find_spec("scipy_openblas32")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        libraries = sorted((Path(location) / "lib").glob("libscipy_openblas*.so"))
        if libraries:
            return str(libraries[0])
    return None


def register_scipy_openblas() -> Optional[str]:
    """Makes scipy-openblas32, when installed, the layer's OpenBLAS for when the system has none.
    Returns its path."""
    library = scipy_openblas_library()
    if library is not None:
        _flashcte.set_layer_gemm_fallback(library, SCIPY_OPENBLAS_PREFIX)
    return library
