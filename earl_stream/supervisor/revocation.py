"""Revoked keys: the generations of the worker and operator keys, and the worker ids refused (`keys revoke`).

security/keys.py says what a generation is and what revoking a role or a worker id does (and does not) guard.
This module keeps them in STATE_DIR/keys/revoked.json, written durably before the reply, so a restarted
supervisor verifies the same tokens and refuses the same ids, and `keys derive` on the run's host derives the
current generation (`generations_in`). It also rewrites STATE_DIR/keys/worker, the worker key `up`'s launchers
hand workers, when the worker key is revoked: the workers `up` started re-read it when refused
(`protocol.ControlClient`). Evicting a revoked worker is the supervisor's (`serve.py`): like a dead worker's.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from earl_stream.errors import ConfigError
from earl_stream.files import write_durably
from earl_stream.security.keys import REVOCABLE, WORKER_KEY_FILE, KeyRole, keyring, role_token, write_key_file

log = logging.getLogger(__name__)
REVOKED_FILE = "keys/revoked.json"  # in the supervisor's state directory (RUN_DIR under `up`)


def write_worker_key(run_dir: Path, secret: bytes) -> Path:
    """RUN_DIR/keys/worker: the worker key at the run's current generation, what launchers give every worker
    instead of the secret (security/keys.py)."""
    generation = generations_in(run_dir).get(KeyRole.WORKER, 0)
    return write_key_file(run_dir / WORKER_KEY_FILE, role_token(secret, KeyRole.WORKER, generation))


def generations_in(run_dir: Path) -> dict[KeyRole, int]:
    """The role key generations the run in `run_dir` uses (all 0 when nothing was revoked)."""
    return Revocations.load(run_dir).generations


@dataclass
class Revocations:
    """What `keys revoke` changed: role -> generation, and the worker ids refused from then on."""

    path: Path
    generations: dict[KeyRole, int] = field(default_factory=dict)
    workers: set[str] = field(default_factory=set)

    @classmethod
    def load(cls, state_dir: Path) -> Revocations:
        path = state_dir / REVOKED_FILE
        if not path.exists():
            return cls(path)
        try:
            data = json.loads(path.read_text())
            return cls(path, {KeyRole(r): int(g) for r, g in data["generations"].items()}, set(data["workers"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"cannot read the revoked keys in {path} ({exc}): restore it, or start the run with a new "
                              "cluster secret") from None

    def keyring(self, secret: bytes) -> dict[KeyRole, bytes]:
        """Every role's current key (security/keys.py `keyring`)."""
        return keyring(secret, self.generations)

    def revoke(self, target: str, secret: bytes, live_ids: set[str]) -> str:
        """Revoke `target` (a revocable role's name, or a worker id the supervisor knows or knew: `live_ids`);
        returns what was done. A ConfigError names what may be revoked."""
        roles = {r.value: r for r in REVOCABLE}
        if target in roles:
            role = roles[target]
            self.generations[role] = self.generations.get(role, 0) + 1
            self._save()
            if role is KeyRole.WORKER:
                write_key_file(self.path.parent.parent / WORKER_KEY_FILE,
                               role_token(secret, role, self.generations[role]))
            what = (f"the {role.value} key is revoked: generation {self.generations[role]} from now on"
                    + (f"; the new worker key is in {self.path.parent.parent / WORKER_KEY_FILE} (workers `up` started "
                       "re-read it; give others `earl-stream keys derive worker`)" if role is KeyRole.WORKER else ""))
        elif target in live_ids:
            self.workers.add(target)
            self._save()
            what = f"worker {target} is revoked: its messages are refused from now on and it is evicted"
        else:
            raise ConfigError(f"nothing to revoke named {target!r}: revoke a role ({', '.join(roles)}) or the id of a "
                              "worker of this run (`earl-stream status` lists them)")
        log.warning("keys revoke: %s", what)
        return what

    def forget_workers(self) -> None:
        """A fresh run in the same state directory: its worker ids are new ones."""
        self.workers.clear()
        self._save()

    def _save(self) -> None:
        data = {"generations": {r.value: g for r, g in self.generations.items()}, "workers": sorted(self.workers)}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_durably(self.path, json.dumps(data).encode())
