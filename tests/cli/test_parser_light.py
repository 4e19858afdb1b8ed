"""The command line builds its parser without torch or transformers: `earl-stream status`, `stop`, `keys`,
`--help` and every other light command start in well under a second (they took 8 s while `cli/sft.py`
imported the SFT loop to read its knobs)."""

from __future__ import annotations

import subprocess
import sys


def test_building_the_parser_imports_neither_torch_nor_transformers() -> None:
    code = ("import sys\nfrom earl_stream.cli.main import build_parser\nbuild_parser().parse_args(['status'])\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_the_sft_package_still_offers_its_names() -> None:
    import earl_stream.sft as sft
    from earl_stream.sft.loop import SFTConfig

    assert sft.SFTConfig is SFTConfig and callable(sft.run_sft) and callable(sft.tokenize_chat)
