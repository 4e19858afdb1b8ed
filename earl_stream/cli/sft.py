"""`earl-stream sft --model DIR --data FILE.jsonl --out DIR [key=value ...]`: supervised fine-tuning of a
Hugging Face causal LM on chat transcripts, on a pool of trainer ranks.

Owns the command line (its parser and `key=value` overrides of `sft.loop.SFTConfig`), starting the
pool (one process per rank of dp x fsdp x tp x sp, a gloo / NCCL group on loopback, each with its
Prometheus endpoint), and the order of the examples (a seeded shuffle per epoch, the same on every
rank). The data is `sft.data`'s, the step `sft.step`'s, the loop `sft.loop`'s. `out` ends up a Hugging
Face model directory that `model.path=out` runs RL from, with the trainer's checkpoints under
`out/checkpoints/`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import socket
from typing import TYPE_CHECKING, Any

import numpy as np

from earl_stream.config.fields import apply_override, build
from earl_stream.errors import ConfigError
from earl_stream.sft.config import SFTConfig

if TYPE_CHECKING:
    from earl_stream.sft.data import Example

__all__ = ["add_parser", "load_sft_config", "run_sft_command"]

log = logging.getLogger(__name__)


def add_parser(sub: Any) -> None:
    """Add the `sft` command to the CLI's subparsers."""
    p = sub.add_parser("sft", help="supervised fine-tuning on chat transcripts (JSONL of {\"messages\": [...]})",
                       description="Trains on the assistant tokens of each transcript (chat template of the model's "
                                   "tokenizer) with the trainer pool's plans and packing; OUT becomes a model "
                                   "directory that model.path=OUT starts an RL run from. key=value sets SFT knobs, "
                                   "e.g. lr=1e-5 epochs=2 fsdp=2; `sft --fields` lists them.")
    p.add_argument("--model", help="Hugging Face model directory (with a chat template)")
    p.add_argument("--data", help="transcripts, one JSON object {\"messages\": [...]} a line")
    p.add_argument("--out", help="output directory (model, tokenizer, checkpoints/)")
    p.add_argument("--fields", action="store_true", help="list the key=value knobs and exit")
    p.add_argument("overrides", nargs="*", metavar="key=value")


def load_sft_config(overrides: list[str]) -> SFTConfig:
    """SFTConfig from `key=value` items; every problem reported in one ConfigError."""
    raw: dict[str, Any] = {}
    errors: list[str] = []
    for item in overrides:
        apply_override(raw, item, errors)
    cfg = build(SFTConfig, raw, "", errors) if not errors else None
    if errors or cfg is None:
        raise ConfigError("sft: " + "; ".join(errors))
    return cfg


def run_sft_command(args: argparse.Namespace) -> int:
    from earl_stream.config.fields import field_help

    if args.fields:
        for name, text in field_help(SFTConfig):
            print(f"{name:22s} {text}")
        return 0
    missing = [f"--{k}" for k in ("model", "data", "out") if not getattr(args, k)]
    if missing:
        raise ConfigError(f"sft needs {', '.join(missing)}")
    cfg = load_sft_config(args.overrides)
    examples = _examples(args.model, args.data)  # refuses a malformed file before any process starts
    world = cfg.plan.world
    if world == 1:
        report = _rank(0, 1, 0, args.model, args.data, args.out, cfg)
    else:
        import torch.multiprocessing as mp

        port = _free_port()
        mp.start_processes(_rank_main, args=(world, port, args.model, args.data, args.out, cfg), nprocs=world,
                           join=True, start_method="spawn")
        with open(os.path.join(args.out, "sft_report.json")) as fh:
            report = json.load(fh)
    print(f"sft: {len(examples)} transcripts, {report['steps']} steps, loss {report['first_loss']:.4f} -> "
          f"{report['final_loss']:.4f} in {report['train_seconds']:.1f}s; model written to {args.out}")
    return 0


def _examples(model_dir: str, data: str) -> list[Example]:
    from earl_stream.model.chat import ChatFormat
    from earl_stream.model.loading import load_tokenizer
    from earl_stream.sft.data import load_transcripts, tokenize_chat

    tokenizer = load_tokenizer(model_dir)
    fmt = ChatFormat(tokenizer)
    return [tokenize_chat(tokenizer, m, fmt) for m in load_transcripts(data)]


def epoch_batches(n: int, cfg: SFTConfig) -> tuple[int, Any]:
    """(steps, step -> example indices): a seeded shuffle per epoch, `batch_size` indices a step."""
    steps = cfg.steps or max(1, math.ceil(cfg.epochs * n / cfg.batch_size))

    def indices(step: int) -> list[int]:
        out = []
        for k in range(step * cfg.batch_size, (step + 1) * cfg.batch_size):
            epoch, pos = divmod(k, n)
            out.append(int(np.random.default_rng([cfg.seed, epoch]).permutation(n)[pos]))
        return out

    return steps, indices


def _rank_main(rank: int, world: int, port: int, model_dir: str, data: str, out: str, cfg: SFTConfig) -> None:
    _rank(rank, world, port, model_dir, data, out, cfg)


def _rank(rank: int, world: int, port: int, model_dir: str, data: str, out: str, cfg: SFTConfig) -> dict[str, Any]:
    """One rank of the pool: load, lay out, train, write (rank 0 writes the report)."""
    import torch
    import torch.distributed as dist

    from earl_stream import metrics as M
    from earl_stream.devices import resolve_device
    from earl_stream.model.loading import load_model
    from earl_stream.progress import progress
    from earl_stream.sft.loop import place_model, run_sft
    from earl_stream.workers.mesh import pool_backend

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s sft[{rank}] %(message)s")
    if world > 1:
        dist.init_process_group(pool_backend(), init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(cfg.seed)
        M.start_metrics_server("127.0.0.1")
        examples = _examples(model_dir, data)
        model, tokenizer = load_model(model_dir)
        placement = place_model(model, cfg, rank=rank, world=world, device=resolve_device(cfg.device, key="device", local_rank=rank,
                                                                                 local_ranks=world))
        steps, indices = epoch_batches(len(examples), cfg)
        # rank 0 shows the progress; the other ranks train the same steps in silence
        with progress("sft", steps, "steps") if rank == 0 else contextlib.nullcontext() as bar:
            report = run_sft(model, tokenizer, lambda s: [examples[i] for i in indices(s)], cfg, placement,
                             steps=steps, out=out, rank=rank,
                             progress=bar.update if bar is not None else lambda *_: None).as_dict()
        if rank == 0:
            with open(os.path.join(out, "sft_report.json"), "w") as fh:
                json.dump({**report, "config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}}, fh, indent=2)
        return report
    finally:
        if world > 1:
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
