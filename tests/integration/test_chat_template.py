"""Chat prompts (``roles/data/chat.py``) in a fresh interpreter: a bare tokenizer renders its
prompts without importing transformers. The rest is ``tests/unit/test_chat_template.py``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ..support.task import write_tokenizer


def test_a_bare_tokenizer_never_imports_transformers(tmp_path: Path) -> None:
    model = write_tokenizer(tmp_path / "bare")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "1+1="}\n')
    code = (
        "import sys\n"
        "from laminar.roles.data.config import DataConfig\n"
        "from laminar.roles.data.prompts import load_prompts\n"
        f"c = DataConfig(prompts={str(prompts)!r}, tokenizer={str(model)!r}, reward='m:f')\n"
        "loaded = load_prompts(c)\n"
        "assert loaded.chat is None and len(loaded.prompts.rows) == 1\n"
        "print('transformers' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
