"""Least privilege on the control plane: keys derived per role from the cluster secret (earl_stream/security/keys.py),
and a real supervisor that refuses, names the role needed, counts and changes nothing for a message signed
with a key whose role does not allow it (supervisor/access.py)."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
from cluster import Cluster

from earl_stream import protocol as P
from earl_stream.errors import ConfigError, ProtocolError
from earl_stream.security.keys import AgentKeyError, KeyRole, agent_key, check_agent_key, key_for, parse_role_token, role_of, role_token
from earl_stream.security.secret import load_secret

SECRET = b"0123456789abcdef" * 4


def test_role_keys_are_derived_distinct_and_parse_back() -> None:
    tokens = {role: role_token(SECRET, role) for role in (KeyRole.WORKER, KeyRole.OPERATOR, KeyRole.READONLY)}
    assert len(set(tokens.values())) == 3 and all(SECRET not in t for t in tokens.values())
    assert role_token(SECRET, KeyRole.READONLY) == tokens[KeyRole.READONLY]  # deterministic: one file sets up a run
    for role, token in tokens.items():
        parsed = parse_role_token(token)
        assert parsed is not None and parsed.role is role and role_of(token) is role
    assert role_of(SECRET) is KeyRole.CLUSTER and role_of(None) is None
    # the cluster secret signs as the role a command needs; a role key signs as itself
    assert key_for(SECRET, KeyRole.READONLY) == tokens[KeyRole.READONLY]
    assert key_for(tokens[KeyRole.READONLY], KeyRole.OPERATOR) == tokens[KeyRole.READONLY]
    with pytest.raises(ConfigError, match="malformed readonly key"):
        parse_role_token(b"earl-readonly-abc:def")
    with pytest.raises(ConfigError, match="per episode"):
        role_token(SECRET, KeyRole.AGENT)


def test_every_message_the_supervisor_handles_belongs_to_a_role() -> None:
    """Workers sign with the worker key, not the cluster secret: a message the supervisor handles (`_on_<name>`)
    that no role may send would be refused from every worker (an allocation failure's `TrainerOom` once was)."""
    from earl_stream.supervisor import access
    from earl_stream.supervisor.server import Supervisor

    classes = {c.__name__.lower(): c for c in vars(P).values() if isinstance(c, type)}
    handled = [classes[n.removeprefix("_on_")] for n in dir(Supervisor) if n.startswith("_on_")]
    assert P.TrainerOom in handled and P.Heartbeat in handled
    roles = access._ALLOWED.values()
    assert [c.__name__ for c in handled if not any(issubclass(c, allowed) for allowed in roles)] == []
    assert issubclass(P.TrainerOom, access._ALLOWED[KeyRole.WORKER])


def test_agent_keys_hold_for_their_episode_until_they_expire() -> None:
    key = agent_key(SECRET, "g1-e1", ttl_s=10, now=1000.0)
    assert role_of(key.encode()) is KeyRole.AGENT
    assert check_agent_key(SECRET, key, now=1005.0) == "g1-e1"
    with pytest.raises(AgentKeyError, match="expired"):
        check_agent_key(SECRET, key, now=1012.0)
    with pytest.raises(AgentKeyError, match="not this run's"):
        check_agent_key(b"another secret of 16+ bytes", key, now=1005.0)
    forged = key.replace("-g1-e1", "-g1-e2")  # the same MAC claimed for another episode
    with pytest.raises(AgentKeyError, match="not this run's"):
        check_agent_key(SECRET, forged, now=1005.0)
    with pytest.raises(AgentKeyError, match="malformed"):
        check_agent_key(SECRET, "earl-agent-x", now=1005.0)


@pytest.mark.slow
def test_each_role_is_allowed_only_its_messages(tmp_path: Path, tiny_model_dir: Path) -> None:
    cluster = Cluster(tmp_path, tiny_model_dir)
    try:
        cluster.start_supervisor()
        secret = load_secret(str(cluster.secret_file))
        assert secret is not None
        readonly, operator, worker = (role_token(secret, r) for r in (KeyRole.READONLY, KeyRole.OPERATOR, KeyRole.WORKER))
        attach = P.EnvAttach(spec="tictactoe", name="t2")
        # read-only: status and the episode window, nothing that changes the run
        assert isinstance(cluster.call(readonly, P.StatusRequest()), P.StatusReply)
        assert isinstance(cluster.call(readonly, P.RecentEpisodes()), P.RecentEpisodesReply)
        for msg in (P.Scale(replicas=3), attach, P.EnvDetach(name="tictactoe"), P.Finished(reason="x"),
                    P.Register(role=P.Role.ROLLOUT, shard_address="127.0.0.1:1")):
            with pytest.raises(ProtocolError, match="not allowed with the readonly key: it needs the (operator|worker) key"):
                cluster.call(readonly, msg)
        # the worker key registers workers, never operates the run
        assert isinstance(cluster.call(worker, P.Register(role=P.Role.ROLLOUT, shard_address="127.0.0.1:1")),
                          P.Registered)
        for msg in (P.Scale(replicas=3), attach, P.StatusRequest()):
            with pytest.raises(ProtocolError, match="not allowed with the worker key"):
                cluster.call(worker, msg)
        # the operator key operates, but registers no worker
        with pytest.raises(ProtocolError, match="it needs the worker key"):
            cluster.call(operator, P.Register(role=P.Role.TRAINER, shard_address="127.0.0.1:2"))
        status = cluster.status()
        assert [w["role"] for w in status["workers"]] == ["rollout"]  # refused messages changed nothing
        assert status["pools"]["rollout"]["desired"] is None and len(status["envs"]) == 1
        reply = cluster.call(operator, P.Scale(replicas=2))
        assert isinstance(reply, P.ScaleReply) and reply.replicas == 2
        assert "t2" in json.loads(cluster.call(operator, attach).envs_json)[-1]["name"]  # type: ignore[attr-defined]
        ready = json.loads((tmp_path / "ready.json").read_text())
        text = urllib.request.urlopen(f"http://{ready['metrics_address']}/metrics", timeout=10).read().decode()
        counts = dict(re.findall(r'earl_security_refused_total\{plane="control",reason="(\w+)"\} (\S+)', text))
        assert float(counts["role"]) == 9
        assert "signed with the readonly key" in (tmp_path / "supervisor.log").read_text()
    finally:
        cluster.stop()


@pytest.mark.live
@pytest.mark.slow
def test_commands_sign_with_the_key_of_their_role(tmp_path: Path, tiny_model_dir: Path) -> None:
    cluster = Cluster(tmp_path, tiny_model_dir)
    try:
        cluster.start_supervisor()
        out = cluster.cli("keys", "derive", "readonly", "--out", str(tmp_path / "ro.key"))
        assert out.returncode == 0, out.stderr
        assert (tmp_path / "ro.key").stat().st_mode & 0o777 == 0o600
        shown = cluster.cli("keys", "show")
        assert shown.returncode == 0 and "operator " in shown.stdout and "readonly " in shown.stdout
        ro = ["--supervisor", cluster.address, "--secret-file", str(tmp_path / "ro.key")]
        status = cluster.cli("status", "--json", *ro)
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["address"] == cluster.address
        for args in (["scale", "--replicas", "2"], ["env", "attach", "tictactoe", "--name", "t3", "--wait", "0"]):
            refused = cluster.cli(*args, *ro)
            assert refused.returncode == 2 and "Traceback" not in refused.stderr
            assert "needs the operator key" in refused.stderr, refused.stderr
        exported = cluster.cli("episodes", "export", str(tmp_path / "eps.parquet"), *ro)  # metadata: read-only
        assert exported.returncode == 0 and "wrote 0 episodes" in exported.stdout, exported.stderr
        # with the cluster secret a command derives its role's key: scale signs as the operator
        assert cluster.cli("scale", "--replicas", "1", "--supervisor", cluster.address).returncode == 0
        assert cluster.status()["pools"]["rollout"]["desired"] == 1
    finally:
        cluster.stop()


@pytest.mark.slow
def test_a_command_given_an_agent_key_is_told_what_it_is(tmp_path: Path, tiny_model_dir: Path) -> None:
    cluster = Cluster(tmp_path, tiny_model_dir)
    try:
        cluster.start_supervisor()
        secret = load_secret(str(cluster.secret_file))
        assert secret is not None
        (tmp_path / "agent.key").write_text(agent_key(secret, "g-1", 60))
        out = cluster.cli("status", "--supervisor", cluster.address, "--secret-file", str(tmp_path / "agent.key"))
        assert out.returncode == 2 and "Traceback" not in out.stderr
        assert "authentication failed" in out.stderr and "holds an agent key" in out.stderr, out.stderr
    finally:
        cluster.stop()


@pytest.mark.slow
def test_a_role_key_reaches_an_encrypting_supervisor(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A role key carries the supervisor's CURVE public key: its holder connects without the secret."""
    cluster = Cluster(tmp_path, tiny_model_dir, "security.encrypt=true")
    try:
        cluster.start_supervisor()
        secret = load_secret(str(cluster.secret_file))
        assert secret is not None
        readonly = role_token(secret, KeyRole.READONLY)
        client = P.ControlClient(cluster.address, timeout_s=10, secret=readonly, encrypt=True)
        try:
            assert isinstance(client.call(P.StatusRequest()), P.StatusReply)
            with pytest.raises(ProtocolError, match="needs the operator key"):
                client.call(P.Scale(replicas=1))
        finally:
            client.close()
    finally:
        cluster.stop()
