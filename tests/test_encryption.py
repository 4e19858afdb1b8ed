"""security.encrypt (earl_stream/security/encryption.py): data-plane frames are encrypted on the wire (a sniffing proxy
sees none of the pulled bytes; it does without encryption), a flipped ciphertext bit fails the frame's tag, an
encrypting client refuses a node that does not encrypt; the control plane speaks CURVE (a client that does not
encrypt gets no answer, and its timeout says what to pass); a whole `up` run trains encrypted, and `status`
run from its directory finds out by itself that it must encrypt."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from earl_stream import protocol as P
from earl_stream.errors import ControlPlaneTimeout, StoreError
from earl_stream.security.encryption import ENCRYPT_ENV
from earl_stream.security.secret import SECRET_ENV
from earl_stream.store import ShardClient, ShardNode

SECRET = b"cluster-secret-0123456789"
MARKER = np.frombuffer(b"PLAINTEXT-MARKER" * 4096, dtype=np.uint8)  # 64 KiB a sniffer could not miss


class Sniffer:
    """Relays one connection byte for byte and keeps what the node sent; `tamper(offset, chunk)` may change it."""

    def __init__(self, target: str, tamper: Callable[[int, bytes], bytes] = lambda offset, chunk: chunk) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.target, self.tamper, self.seen = target, tamper, bytearray()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        client, _ = self.listener.accept()
        host, port = self.target.rsplit(":", 1)
        node = socket.create_connection((host, int(port)))
        threading.Thread(target=self._pipe, args=(client, node, False), daemon=True).start()
        self._pipe(node, client, True)

    def _pipe(self, src: socket.socket, dst: socket.socket, from_node: bool) -> None:
        try:
            while data := src.recv(65536):
                if from_node:
                    data = self.tamper(len(self.seen), data)
                    self.seen += data
                dst.sendall(data)
        except OSError:
            pass
        dst.close()


@pytest.mark.parametrize("encrypt", [False, True])
def test_pulled_bytes_are_unreadable_on_the_wire_only_when_encrypting(encrypt: bool) -> None:
    with ShardNode(secret=SECRET, shm=False, encrypt=encrypt) as node, \
            ShardClient(secret=SECRET, transport="tcp", timeout_s=10.0, encrypt=encrypt) as client:
        node.put("k", MARKER)
        sniffer = Sniffer(node.address)
        (got,) = client.pull(sniffer.address, [("k", 0, MARKER.size)])
        np.testing.assert_array_equal(got, MARKER)
        assert (b"PLAINTEXT-MARKER" in sniffer.seen) is not encrypt
        assert len(sniffer.seen) > MARKER.size


def test_a_flipped_ciphertext_bit_fails_the_frame_tag() -> None:
    def flip(offset: int, chunk: bytes) -> bytes:
        at = 5_000 - offset  # inside the reply's encrypted payload, well after the handshake
        if 0 <= at < len(chunk):
            chunk = chunk[:at] + bytes([chunk[at] ^ 0x01]) + chunk[at + 1:]
        return chunk

    with ShardNode(secret=SECRET, shm=False, encrypt=True) as node, \
            ShardClient(secret=SECRET, transport="tcp", timeout_s=10.0, encrypt=True) as client:
        node.put("k", MARKER)
        sniffer = Sniffer(node.address, flip)
        with pytest.raises(StoreError, match="MAC|broke the protocol"):
            client.pull(sniffer.address, [("k", 0, MARKER.size)])


def test_both_ends_must_agree_and_ucx_is_not_used() -> None:
    with ShardNode(secret=SECRET, shm=False, encrypt=False) as plain, ShardNode(secret=SECRET, shm=False, encrypt=True) as sealed:
        for n in (plain, sealed):
            n.put("k", np.arange(10))
        with ShardClient(secret=SECRET, timeout_s=10.0, encrypt=True) as client:
            with pytest.raises(StoreError, match="does not encrypt its frames but this process does"):
                client.pull(plain.address, [("k", 0, 3)])
            np.testing.assert_array_equal(client.pull(sealed.address, [("k", 0, 3)])[0], [0, 1, 2])
        with ShardClient(secret=SECRET, timeout_s=10.0, encrypt=False) as client:  # a node that encrypts is followed
            np.testing.assert_array_equal(client.pull(sealed.address, [("k", 2, 4)])[0], [2, 3])
    with pytest.raises(StoreError, match="UCX bytes are not encrypted"):
        ShardClient(secret=SECRET, transport="ucx", encrypt=True)
    with pytest.raises(StoreError, match="needs the cluster secret"):
        ShardNode(encrypt=True)


def _supervisor(tmp_path: Path, secret_file: Path) -> tuple[subprocess.Popen, str]:
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen([sys.executable, "-m", "earl_stream", "supervisor", "--bind", "127.0.0.1:0", "--ready-file",
                             str(ready), "--secret-file", str(secret_file), f"run_dir={tmp_path / 'run'}",
                             "model.path=/nonexistent", "security.encrypt=true"], stderr=subprocess.PIPE, text=True)
    from cluster import wait_for

    wait_for(lambda: ready.exists() or proc.poll() is not None, 60, "the supervisor's ready file")
    assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
    return proc, json.loads(ready.read_text())["address"]


def test_the_control_plane_speaks_curve(tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET)
    proc, address = _supervisor(tmp_path, secret_file)
    try:
        sealed = P.ControlClient(address, timeout_s=10, secret=SECRET, encrypt=True)
        assert json.loads(sealed.call(P.StatusRequest()).status_json)["policy_version"] == 0
        sealed.close()
        plain = P.ControlClient(address, timeout_s=2, secret=SECRET, encrypt=False)
        with pytest.raises(ControlPlaneTimeout, match="pass --encrypt"):
            plain.call(P.StatusRequest())
        plain.close()
    finally:
        proc.terminate()
        proc.wait(20)


def test_a_command_given_the_runs_secret_file_encrypts_as_the_run_does(tmp_path: Path) -> None:
    """`status --supervisor ADDR --secret-file RUN/secret` reads RUN/config.yaml, as `--supervisor` alone
    does through the run's ready file: no `--encrypt` needed against a run that encrypts."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "secret").write_bytes(SECRET)
    (run / "config.yaml").write_text("security:\n  encrypt: true\n")  # as `up` writes the run's config
    proc, address = _supervisor(tmp_path, run / "secret")
    try:
        env = {k: v for k, v in os.environ.items() if k not in (SECRET_ENV, ENCRYPT_ENV)}
        out = subprocess.run([sys.executable, "-m", "earl_stream", "status", "--json", "--supervisor", address,
                              "--secret-file", str(run / "secret")], env=env, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        assert json.loads(out.stdout)["policy_version"] == 0
    finally:
        proc.terminate()
        proc.wait(20)


@pytest.mark.live
@pytest.mark.slow
def test_up_trains_with_both_planes_encrypted(tmp_path: Path, tiny_model_dir: Path) -> None:
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "earl_stream", "up", "--steps", "2", "--summary", str(tmp_path / "s.json"),
                           f"model.path={tiny_model_dir}", f"run_dir={run}", "trainer.groups_per_step=2",
                           "trainer.group_size=4", "rollout.groups_in_flight=2", "supervisor.heartbeat_s=0.2",
                           "trainer.nproc=2", "rollout.workers=1", "--encrypt"],  # the flag sets security.encrypt
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["policy_version"] >= 2 and summary["samples_trained"] >= 2 * 2 * 4
    assert "--encrypt" in done.stdout + done.stderr  # the printed worker command carries it
    assert "encrypt: true" in (run / "config.yaml").read_text()


@pytest.mark.parametrize(("launcher", "given", "expected"), [
    ("local", [], False), ("slurm", [], True), ("ray", [], True), ("slurm", ["security.encrypt=auto"], True),
    ("slurm", ["security.encrypt=false"], False), ("local", ["security.encrypt=true"], True)])
def test_encryption_is_on_by_default_exactly_when_the_launcher_spans_hosts(launcher: str, given: list[str],
                                                                           expected: bool) -> None:
    from earl_stream.config import config_from_dict, config_to_dict, load_config

    cfg = load_config(None, [f"launcher.kind={launcher}", *given])
    assert cfg.security.encrypt is expected and cfg.security.tls_on is expected
    assert config_from_dict(config_to_dict(cfg)).security.encrypt is expected  # what workers get stays resolved


def test_an_explicit_ucx_transport_names_the_conflict_with_default_encryption() -> None:
    from earl_stream.config import load_config
    from earl_stream.errors import ConfigError

    with pytest.raises(ConfigError, match="security.encrypt=false to use UCX"):
        load_config(None, ["launcher.kind=slurm", "store.transport=ucx"])
    assert load_config(None, ["launcher.kind=slurm", "store.transport=ucx", "security.encrypt=false"]).security.encrypt \
        is False
    assert load_config(None, ["store.transport=ucx"]).security.encrypt is False


def test_up_logs_which_path_the_planes_take() -> None:
    from earl_stream.cli.up import encryption_line
    from earl_stream.config import load_config

    assert "encrypted (launcher slurm places processes on other hosts)" in \
        encryption_line(load_config(None, ["launcher.kind=slurm"]), "0.0.0.0:5555")
    assert "encrypted (security.encrypt=true)" in encryption_line(load_config(None, ["security.encrypt=true"]), "")
    local = load_config(None, [])
    assert encryption_line(local, "127.0.0.1:0") == \
        "local run: planes not encrypted (the fast path: shared memory, UCX, plain HTTP)"
    assert "workers joining from others travel unencrypted" in encryption_line(local, "0.0.0.0:5555")
