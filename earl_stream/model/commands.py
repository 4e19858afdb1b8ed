"""The `earl-stream model ...` subcommands (`model import SRC OUT_DIR`, `model export RUN_DIR OUT [--merge]`);
the CLI only wires them in."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

__all__ = ["add_model_commands", "run_model_command"]


def add_model_commands(sub: Any) -> None:
    """Add the `model` command and its subcommands to the CLI's subparsers `sub`."""
    p = sub.add_parser("model", help="model tools: import a GGUF file or a Hugging Face directory; export a run's "
                       "LoRA adapter")
    msub = p.add_subparsers(dest="model_command", required=True)
    mi = msub.add_parser("import", help="write SRC as a standard Hugging Face directory that model.path= can use",
                         description="SRC is a .gguf file (any architecture transformers reads from GGUF; needs "
                                     "pip install 'earl_stream[real-model]') or a Hugging Face model directory. "
                                     "OUT_DIR gets float32 safetensors, config, tokenizer and chat template.")
    mi.add_argument("src", metavar="SRC")
    mi.add_argument("out_dir", metavar="OUT_DIR")
    mi.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists and is not empty")
    mi.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template to use instead of (or where "
                    "SRC has none) the source's own")
    me = msub.add_parser("export", help="write a run's latest checkpoint as a PEFT adapter or a merged model",
                         description="A LoRA run (model.lora): OUT gets a PEFT adapter directory (adapter_model."
                                     "safetensors + adapter_config.json naming the base), or with --merge a whole "
                                     "Hugging Face model directory (base + adapter) that transformers and vLLM load "
                                     "as is. A full fine-tuning run's checkpoint is copied as its model directory.")
    me.add_argument("run_dir", metavar="RUN_DIR")
    me.add_argument("out", metavar="OUT")
    me.add_argument("--merge", action="store_true", help="merge the adapter into the base: a whole model directory")
    me.add_argument("--base", metavar="DIR", default="", help="the base model directory (default: the one the "
                    "adapter's config names)")
    me.add_argument("--overwrite", action="store_true", help="replace OUT if it exists and is not empty")


def run_model_command(args: argparse.Namespace) -> int:
    """Run the parsed `model` subcommand; errors are raised as EarlError for the CLI to print."""
    from earl_stream.errors import ModelError
    from earl_stream.model.importing import import_model
    from earl_stream.progress import progress

    if args.model_command == "export":
        from earl_stream.model.export import export_model

        with progress("model export", unit="steps") as bar:
            out = export_model(args.run_dir, args.out, merge=args.merge, base=args.base, overwrite=args.overwrite,
                               progress=bar.update)
        print(json.dumps({"out_dir": str(out), "merged": bool(args.merge)}))
        return 0
    if args.model_command != "import":
        raise AssertionError(args.model_command)
    template = None
    if args.chat_template:
        try:
            template = Path(args.chat_template).read_text()
        except OSError as exc:
            raise ModelError(f"cannot read the chat template {args.chat_template}: {exc.strerror}") from None
    with progress("model import", unit="stages") as bar:
        report = import_model(args.src, args.out_dir, overwrite=args.overwrite, chat_template=template,
                              progress=bar.update)
    print(json.dumps(report.as_dict(), indent=2))
    print(f"use it with: earl-stream up model.path={report.out_dir}")
    return 0
