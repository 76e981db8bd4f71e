"""What the installed package says about itself: one version everywhere, its license, and where
the layer's OpenBLAS comes from without the system's (scripts/test_wheel.sh runs the wheel with
the system libraries hidden; here only the lookup)."""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

import flashcte
from flashcte import _blas, _flashcte

ROOT = Path(__file__).resolve().parents[2]


def test_one_version():
    """CMakeLists.txt's project(VERSION) is the one written; the C++ library (compile
    definition), __version__ and the wheel's metadata (scikit-build-core's regex) read it. The
    CLI's --version is the CTest flashcte_cli.version."""
    cmake = (ROOT / "CMakeLists.txt").read_text()
    written = re.search(r"^project\(flashcte VERSION ([0-9]+\.[0-9]+\.[0-9]+)", cmake, re.M)
    assert written, "CMakeLists.txt has no project(flashcte VERSION x.y.z) line"
    assert _flashcte.version() == written.group(1)
    assert flashcte.__version__ == written.group(1)
    assert importlib.metadata.version("flashcte") == written.group(1)


def test_apache_2_license():
    """flashcte is Apache-2.0: the SPDX expression in the metadata (PEP 639), and the license's
    text in the distribution, the same as the repository's LICENSE."""
    meta = importlib.metadata.metadata("flashcte")
    assert meta["License-Expression"] == "Apache-2.0"
    assert not [c for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    files = importlib.metadata.files("flashcte") or []
    shipped = [f for f in files if f.name == "LICENSE"]
    assert shipped, "no LICENSE in the installed distribution"
    assert shipped[0].read_text() == (ROOT / "LICENSE").read_text()


def test_scipy_openblas_lookup_does_not_import_it(tmp_path, monkeypatch):
    """The fallback is found by path alone: importing scipy_openblas32 would load OpenBLAS before
    the layer sets OPENBLAS_CORETYPE."""
    monkeypatch.syspath_prepend(str(tmp_path))
    package = tmp_path / "scipy_openblas32"
    (package / "lib").mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('imported')\n")
    library = package / "lib" / "libscipy_openblas.so"
    library.write_bytes(b"")
    assert _blas.scipy_openblas_library() == str(library)
    assert "scipy_openblas32" not in sys.modules


def test_scipy_openblas_absent(tmp_path, monkeypatch):
    package = tmp_path / "scipy_openblas32"
    package.mkdir()
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _blas.scipy_openblas_library() is None  # a package without lib/libscipy_openblas*.so


def test_system_openblas_first():
    """With the system's libopenblas.so.0 (the project's machines have it) the layer runs on it,
    whether or not scipy-openblas32 is installed."""
    backend = flashcte.layer_gemm_backend()
    assert "not loadable" not in backend and "libscipy_openblas" not in backend, backend
