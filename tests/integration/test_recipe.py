"""The recipe's command-line parser, in a fresh interpreter, imports no transformers. The recipe
itself is ``tests/unit/test_recipe.py``."""

from __future__ import annotations

import subprocess
import sys


def test_parser_does_not_import_transformers() -> None:
    code = (
        "import sys, laminar.cli as c; c.build_parser(); "
        "print(any(m in sys.modules for m in ('transformers', 'torch', 'tokenizers')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
