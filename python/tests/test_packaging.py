"""What the installed package says about itself: one version everywhere."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import flashcte
from flashcte import _flashcte

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
