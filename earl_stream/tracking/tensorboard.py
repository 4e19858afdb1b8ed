"""TensorBoard: event files under RUN_DIR/tensorboard/<run id>/ (one TensorBoard run per earl_stream run;
`tensorboard --logdir RUN_DIR/tensorboard`), written with torch's SummaryWriter (needs the `tensorboard`
package). Scalars per step; the config and summary.json as text, learning_curve.png as an image.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from earl_stream.tracking.base import TrackerRun


class TensorBoardTracker:
    def __init__(self, run: TrackerRun) -> None:
        self.run = run
        self.logdir = run.dir / "tensorboard" / run.ids["id"]
        self._writer: Any = None

    def start(self, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(self.logdir))
        if not self.run.resume:
            self._writer.add_text("config", _code(yaml.safe_dump(config, sort_keys=False), "yaml"))
            if self.run.tags:
                self._writer.add_text("tags", ", ".join(self.run.tags))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def artifact(self, path: Path) -> None:
        if path.suffix == ".png":
            import numpy as np
            from PIL import Image  # matplotlib's own dependency

            with Image.open(path) as img:
                self._writer.add_image(path.stem, np.asarray(img.convert("RGB")), dataformats="HWC")
        else:
            text = path.read_text()
            if path.suffix == ".json":
                text = _code(json.dumps(json.loads(text), indent=2), "json")
            self._writer.add_text(path.stem, text)
        self._writer.flush()

    def finish(self) -> None:
        if self._writer is not None:
            self._writer.close()


def _code(text: str, lang: str) -> str:
    """TensorBoard renders text as Markdown: a fenced block keeps YAML/JSON readable."""
    return f"```{lang}\n{text}\n```"
