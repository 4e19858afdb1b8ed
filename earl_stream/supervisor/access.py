"""Which control-plane message each key role may send to the supervisor (least privilege; security/keys.py says
who holds which key).

The supervisor verifies a message against every role's key (`security.secret.check_keys`), then asks
`refusal` whether that role may send it. A refused message changes nothing (it is neither handled nor
logged); the sender hears which role it needed, and the refusal is counted
(`earl_security_refused_total{plane="control", reason="role"}`).

`Finished` is two things: an operator's stop (`earl-stream stop`, no worker id) and the trainer's end of the run
after its last step. With the worker key it is only the latter: its worker id must name a live trainer rank the
supervisor registered, so a rollout worker's key (or any worker key alone) cannot stop the run.
"""

from __future__ import annotations

from collections.abc import Callable

from earl_stream import protocol as P
from earl_stream.security.keys import KeyRole

# what only reads the run
_READ = (P.StatusRequest, P.EnvList, P.RecentEpisodes)
# what an operator changes: the pool's size, the environments, stopping the run, revoking keys
_OPERATE = (P.Scale, P.EnvAttach, P.EnvDetach, P.Finished, P.RevokeKey)
# what workers send about their own work (Finished: the trainer's end of the run, from a live trainer rank only)
_WORK = (P.Register, P.Heartbeat, P.RequestPrompts, P.PutMeta, P.RecoverSamples, P.Claim, P.PlanAdopted, P.Release,
         P.PublishVersion, P.Finished, P.PutEval, P.EvalPending, P.TrainerOom)

_ALLOWED: dict[KeyRole, tuple[type, ...]] = {
    KeyRole.READONLY: _READ,
    KeyRole.OPERATOR: _READ + _OPERATE,
    KeyRole.WORKER: _WORK,
}


def allowed(role: KeyRole, msg: object) -> bool:
    """Whether a message signed with `role`'s key may be handled. A client's registration (Role.CLIENT,
    which only names a command's connection) is a read."""
    if role is KeyRole.CLUSTER:
        return True
    if isinstance(msg, P.Register) and msg.role == P.Role.CLIENT:
        return role in (KeyRole.READONLY, KeyRole.OPERATOR, KeyRole.WORKER)
    return isinstance(msg, _ALLOWED.get(role, ()))


def needed(msg: object) -> list[KeyRole]:
    """The roles whose key may send `msg` (the cluster secret always may)."""
    return [role for role in (KeyRole.READONLY, KeyRole.OPERATOR, KeyRole.WORKER) if allowed(role, msg)]


def refusal(role: KeyRole, msg: object, is_trainer: Callable[[str], bool] = lambda _: False) -> str | None:
    """Why a message signed with `role`'s key is refused (None: it is allowed). `is_trainer`: whether a worker id
    names a live trainer rank (a worker key's `Finished` must come from one)."""
    if role is KeyRole.WORKER and isinstance(msg, P.Finished) and not is_trainer(msg.worker_id):
        return (f"Finished from {msg.worker_id or 'no worker'} is not allowed with the worker key: with it, only a live "
                "trainer rank ends the run after its last step; stopping the run needs the operator key (or the "
                "cluster secret): `earl-stream stop`")
    if allowed(role, msg):
        return None
    roles = " or ".join(f"the {r.value} key" for r in needed(msg)) or "no derived key"
    return (f"{type(msg).__name__} is not allowed with the {role.value} key: it needs {roles} (or the cluster "
            "secret); `earl-stream keys derive ROLE` prints a role's key")
