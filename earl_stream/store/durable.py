"""Durable experience: the samples a rollout worker holds, persisted in the run directory so that a
resumed run (`up --resume`) or a worker restarted on the same host trains them instead of playing
their prompts again.

Owns the on-disk format and the slot a worker persists into. What a sample is belongs to
`experience.py`; whether a recovered sample may still be trained is the supervisor ledger's call
(`supervisor/recovery.py`: only groups it still waits for, under their original ordinals).

Layout: RUN_DIR/experience/<hostname>-<n>/gen-<generation>.exp. A worker takes the first slot <n> of
its host whose `lock` file no live process holds (flock), so a worker restarted on the same host
takes over the slot (and the samples) of the one that died, whatever its new worker id.

One file per generation, written at each trainer checkpoint and on a clean stop:

    b"EARLEXP1" | u32 header length | header (JSON) | body

header: {"format": 1, "run": the supervisor's run id, "model": model identity, "checkpoint_version": step of the
checkpoint it goes with, "samples": rows, "body_bytes": n, "body_crc32": crc}. body: an Arrow IPC
stream of one table, the `SampleMeta` columns (`METADATA_SCHEMA`) plus one binary column per token
field (`payload.<field>`: the raw bytes of the field's [total_tokens] array, its `TOKEN_FIELDS`
dtype), and `payload.routed_experts` (a MoE model's recorded routing, `records.ROUTED_EXPERTS`: the raw
bytes of the flat [total_tokens * layers * top_k] array, null for a sample without; its dtype, width and
crc32 are in the row's info) and `payload.images` (a vision-language episode's PNGs back to back,
`records.IMAGES`; null without; spans, sizes and crc32 in the row's info). It is written under a
temporary name, fsync'd, renamed into place and the directory fsync'd; then older generations are deleted, so a
crash at any point leaves one whole generation. A file is refused, with a log line naming it and never an
exception, when it is truncated or corrupt (magic, header, length, crc, Arrow, a row's tensors against its
checksum, a row's routing or images against their crc), or written by another run or for
another model.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import socket
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import numpy as np
import pyarrow as pa

from earl_stream.errors import StoreError
from earl_stream.files import write_durably
from earl_stream.records import IMAGES, ROUTED_EXPERTS, TOKEN_FIELDS, images_info, routing_info
from earl_stream.store.experience import record_checksum
from earl_stream.store.schema import METADATA_SCHEMA, SampleMeta, metas_to_table, table_to_metas

log = logging.getLogger(__name__)
EXPERIENCE_DIR = "experience"
MAGIC = b"EARLEXP1"
FORMAT = 1
_LEN = struct.Struct("!I")
MAX_HEADER_BYTES = 1 << 20
PAYLOAD = "payload."
Sample = tuple[SampleMeta, dict[str, np.ndarray]]  # metadata row, token field -> [total_tokens] array


class PersistRefused(StoreError):
    """A persisted generation that must not be served (corrupt, truncated, another run or model)."""


@dataclasses.dataclass(frozen=True)
class Identity:
    """What a generation must match to be served: the run (the supervisor's `run_id`) and the model."""

    run: str
    model: str


def model_identity(model_dir: Path) -> str:
    """The model directory's resolved path and a hash of its config.json (another model is refused)."""
    try:
        config = (model_dir / "config.json").read_bytes()
    except OSError:
        config = b""
    return f"{model_dir.resolve()}#{hashlib.sha256(config).hexdigest()[:16]}"


def encode(identity: Identity, checkpoint_version: int, samples: Sequence[Sample]) -> bytes:
    """One generation's bytes (see the module docstring)."""
    table = metas_to_table([m for m, _ in samples])
    for name, dtype in TOKEN_FIELDS.items():
        column = [np.ascontiguousarray(f[name], dtype=dtype).tobytes() for _, f in samples]
        table = table.append_column(PAYLOAD + name, pa.array(column, type=pa.large_binary()))
    for name in (ROUTED_EXPERTS, IMAGES):  # optional fields: null where a sample has none
        optional = [np.ascontiguousarray(f[name]).tobytes() if name in f else None for _, f in samples]
        table = table.append_column(PAYLOAD + name, pa.array(optional, type=pa.large_binary()))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    body = sink.getvalue().to_pybytes()
    header = json.dumps({"format": FORMAT, "run": identity.run, "model": identity.model,
                         "checkpoint_version": checkpoint_version, "samples": len(samples),
                         "body_bytes": len(body), "body_crc32": zlib.crc32(body)}).encode()
    return MAGIC + _LEN.pack(len(header)) + header + body


def decode(data: bytes, identity: Identity) -> tuple[dict, list[Sample]]:
    """The header and samples of a generation; `PersistRefused` says why it cannot be served."""
    if data[:len(MAGIC)] != MAGIC:
        raise PersistRefused("not a durable-experience file (bad magic)")
    start = len(MAGIC) + _LEN.size
    if len(data) < start:
        raise PersistRefused("truncated header")
    (n,) = _LEN.unpack_from(data, len(MAGIC))
    if n > MAX_HEADER_BYTES or len(data) < start + n:
        raise PersistRefused("truncated header")
    try:
        header = json.loads(data[start:start + n])
        body_bytes, crc = int(header["body_bytes"]), int(header["body_crc32"])
    except (ValueError, KeyError, TypeError) as exc:
        raise PersistRefused(f"unreadable header ({exc})") from None
    if header.get("format") != FORMAT:
        raise PersistRefused(f"format {header.get('format')!r}, this build reads {FORMAT}")
    if header.get("run") != identity.run:
        raise PersistRefused(f"written by another run ({header.get('run')!r}, this one is {identity.run!r})")
    if header.get("model") != identity.model:
        raise PersistRefused(f"written for another model ({header.get('model')}, this run uses {identity.model})")
    body = data[start + n:]
    if len(body) != body_bytes:
        raise PersistRefused(f"truncated: {len(body)} of {body_bytes} body bytes")
    if zlib.crc32(body) != crc:
        raise PersistRefused("corrupt: the body's crc32 does not match its header")
    return header, _samples(body)


def _samples(body: bytes) -> list[Sample]:
    try:
        with pa.ipc.open_stream(pa.py_buffer(body)) as reader:
            table = reader.read_all()
        metas = table_to_metas(table.select([n for n in METADATA_SCHEMA.names if n in table.column_names]))
        payload = {name: table.column(PAYLOAD + name).to_pylist() for name in TOKEN_FIELDS}
        routed, images = ((table.column(PAYLOAD + n).to_pylist() if PAYLOAD + n in table.column_names
                           else [None] * table.num_rows) for n in (ROUTED_EXPERTS, IMAGES))
    except (pa.ArrowException, KeyError, StoreError) as exc:
        raise PersistRefused(f"unreadable Arrow body ({exc})") from None
    out: list[Sample] = []
    for i, meta in enumerate(metas):
        try:
            fields = {name: np.frombuffer(payload[name][i], dtype=dtype).copy() for name, dtype in TOKEN_FIELDS.items()}
        except (ValueError, TypeError) as exc:  # a crafted body: its crc matches, its payload does not parse
            raise PersistRefused(f"sample {meta.sample_id}: unreadable payload ({exc})") from None
        if any(a.shape != (meta.total_tokens,) for a in fields.values()) or record_checksum(fields) != meta.checksum:
            raise PersistRefused(f"sample {meta.sample_id}: its tensors do not match its checksum")
        found = _routing(meta, routed[i])
        if found is not None:
            fields[ROUTED_EXPERTS] = found
        pngs = _images(meta, images[i])
        if pngs is not None:
            fields[IMAGES] = pngs
        out.append((meta, fields))
    return out


def _routing(meta: SampleMeta, data: bytes | None) -> np.ndarray | None:
    """A row's flat routed_experts, checked against what its info says (dtype, width, crc32)."""
    try:
        described = routing_info(json.loads(meta.info_json))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise PersistRefused(f"sample {meta.sample_id}: unreadable {ROUTED_EXPERTS} description ({exc})") from None
    if described is None:
        if data is not None:
            raise PersistRefused(f"sample {meta.sample_id}: {ROUTED_EXPERTS} stored but not described by its info")
        return None
    dtype, width, crc = described
    if data is None:
        raise PersistRefused(f"sample {meta.sample_id}: its info describes {ROUTED_EXPERTS} the file does not hold")
    if len(data) != meta.total_tokens * width * dtype.itemsize or zlib.crc32(data) != crc:
        raise PersistRefused(f"sample {meta.sample_id}: its {ROUTED_EXPERTS} do not match their checksum")
    return np.frombuffer(data, dtype=dtype).copy()


def _images(meta: SampleMeta, data: bytes | None) -> np.ndarray | None:
    """A row's images (PNGs back to back), checked against what its info says (sizes, crc32)."""
    try:
        described = images_info(json.loads(meta.info_json))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise PersistRefused(f"sample {meta.sample_id}: unreadable {IMAGES} description ({exc})") from None
    if described is None:
        if data is not None:
            raise PersistRefused(f"sample {meta.sample_id}: {IMAGES} stored but not described by its info")
        return None
    spans, crc = described
    if data is None:
        raise PersistRefused(f"sample {meta.sample_id}: its info describes {IMAGES} the file does not hold")
    if len(data) != sum(span[4] for span in spans) or zlib.crc32(data) != crc:
        raise PersistRefused(f"sample {meta.sample_id}: its {IMAGES} do not match their checksum")
    return np.frombuffer(data, dtype=np.uint8).copy()


class Slot:
    """This worker's directory under RUN_DIR/experience, held (flock) while the process lives."""

    def __init__(self, run_dir: Path | str, host: str = "") -> None:
        root = Path(run_dir) / EXPERIENCE_DIR
        root.mkdir(parents=True, exist_ok=True)
        host = (host or socket.gethostname()).replace("/", "_")
        for n in range(1 << 16):
            path = root / f"{host}-{n}"
            path.mkdir(exist_ok=True)
            lock: IO[bytes] = open(path / "lock", "ab")  # noqa: SIM115  # held open for the process's life
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                lock.close()
                continue
            self.dir, self._lock = path, lock
            break
        else:  # pragma: no cover - 65,536 live workers on one host
            raise StoreError(f"no free durable-experience slot under {root}")
        self.generation = max((g for g, _ in self._generations()), default=0)

    def _generations(self) -> list[tuple[int, Path]]:
        out = []
        for p in self.dir.glob("gen-*.exp"):
            try:
                out.append((int(p.stem.split("-")[1]), p))
            except (IndexError, ValueError):
                continue
        return sorted(out)

    def write(self, identity: Identity, checkpoint_version: int, samples: Sequence[Sample]) -> Path:
        """Persist `samples` as the next generation, atomically; older ones are deleted. OSError on failure."""
        data = encode(identity, checkpoint_version, samples)
        self.generation += 1
        final = self.dir / f"gen-{self.generation:08d}.exp"
        write_durably(final, data)
        for g, p in self._generations():
            if g < self.generation:
                p.unlink(missing_ok=True)
        return final

    def load(self, identity: Identity) -> tuple[Path | None, list[Sample]]:
        """The newest generation's samples ([] when there is none or it is refused, which is logged)."""
        for tmp in self.dir.glob("*.tmp"):  # a write cut short: never renamed, never valid
            tmp.unlink(missing_ok=True)
        gens = self._generations()
        if not gens:
            return None, []
        path = gens[-1][1]
        try:
            header, samples = decode(path.read_bytes(), identity)
        except (PersistRefused, OSError) as exc:
            log.warning("durable experience: refusing %s: %s; its samples are re-played instead", path, exc)
            return path, []
        log.info("durable experience: %s holds %d samples (checkpoint %d)", path, len(samples),
                 header.get("checkpoint_version", -1))
        return path, samples

    def close(self) -> None:
        self._lock.close()
