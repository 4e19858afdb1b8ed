"""A real Prometheus server scrapes a running `earl-stream up` through the run's file_sd targets file,
using dashboards/prometheus.yml, and answers queries for the earl metrics of every role.

Needs the `prometheus` binary (Debian package: `bash scripts/install-prometheus.sh`); skips without it.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_dashboards import ROLES, RunningUp

pytestmark = pytest.mark.slow

SHIPPED_CONFIG = Path(__file__).resolve().parents[1] / "dashboards" / "prometheus.yml"
# One query per role, with the role whose processes must answer it.
ROLE_QUERIES = {
    "rollout": ["earl_rollout_tokens_total", "earl_rollout_episodes_total", "earl_store_bytes_held"],
    "trainer": ["earl_trainer_steps_total", "earl_trainer_step_seconds_count", "earl_store_pull_bytes_total"],
    "supervisor": ["earl_samples", "earl_policy_version", "earl_workers", "earl_context_length_tokens"],
}


@pytest.fixture(scope="session")
def prometheus_binary() -> str:
    """The server binary. Session-scoped and listed before the model fixture: a skip builds no model."""
    found = shutil.which("prometheus") or ("/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None)
    if found is None:
        pytest.skip("the prometheus server is not installed (Debian: `bash scripts/install-prometheus.sh` as root)")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(targets_file: Path, path: Path) -> Path:
    """The shipped config, pointed at this run's targets file, scraping and re-reading it every second."""
    cfg = yaml.safe_load(SHIPPED_CONFIG.read_text())
    cfg["global"].update(scrape_interval="1s", evaluation_interval="1s")
    (job,) = cfg["scrape_configs"]
    job["file_sd_configs"] = [{"files": [str(targets_file)], "refresh_interval": "1s"}]
    path.write_text(yaml.safe_dump(cfg))
    return path


def _query(base: str, promql: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def _poll(what: str, check: Callable[[], Any], timeout_s: float, logs: Callable[[], str]) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except OSError as exc:  # the server is still starting
            last = exc
        else:
            if last:
                return last
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}; last answer: {last}\n{logs()}")


class Prometheus:
    """A Prometheus server on 127.0.0.1 with its own storage, stopped (and reaped) on exit."""

    def __init__(self, binary: str, config: Path, tmp: Path) -> None:
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "prometheus.log"
        self.cmd = [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}"]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Prometheus:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    def log_tail(self, n: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def ready(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, f"prometheus exited:\n{self.log_tail()}"
        with urllib.request.urlopen(f"{self.base}/-/ready", timeout=2) as resp:
            return resp.status == 200


@pytest.mark.live
def test_prometheus_scrapes_every_role(prometheus_binary: str, tmp_path: Path, tiny_model_dir: Path) -> None:
    with RunningUp(tmp_path, tiny_model_dir, "rollout.workers=2") as up:
        targets = up.wait_for_roles(ROLES, timeout_s=60)
        config = _config(up.targets_file, tmp_path / "prometheus.yml")
        with Prometheus(prometheus_binary, config, tmp_path) as prom:
            def logs() -> str:
                return f"--- prometheus ---\n{prom.log_tail()}\n--- up ---\n{up.log_tail()}"

            _poll("prometheus to be ready", prom.ready, 30, logs)

            def all_up() -> dict[str, str]:
                current = up.targets()
                healthy = {r["metric"]["instance"]: r["metric"]["role"] for r in _query(prom.base, "up == 1")}
                return healthy if set(current) <= set(healthy) and set(ROLES) <= set(healthy.values()) else {}

            healthy = _poll("every target of the run to be up", all_up, 30, logs)
            assert set(targets) <= set(healthy)
            assert sorted(healthy.values()).count("rollout") == 2

            for role, names in ROLE_QUERIES.items():
                for name in names:
                    selector = f'{name}{{role="{role}"}}'
                    result = _poll(selector, lambda q=selector: _query(prom.base, q), 20, logs)
                    assert all(r["metric"]["job"] == "earl_stream" and r["metric"]["instance_name"] for r in result)

            # Values make sense, not only names: two live rollout workers, tokens flowing, training advancing.
            _poll("the supervisor to count 2 live rollout workers", lambda: _query(
                prom.base, 'earl_workers{role="supervisor", pool="rollout", health="alive"} == 2'), 20, logs)
            _poll("a positive rollout token rate", lambda: _query(
                prom.base, 'sum(rate(earl_rollout_tokens_total[5s])) > 0'), 20, logs)
            _poll("trainer steps > 1", lambda: _query(prom.base, 'sum(earl_trainer_steps_total) > 1'), 20, logs)
            assert prom.proc is not None and prom.proc.poll() is None
        assert prom.proc.returncode is not None


def _tls_block() -> dict[str, Any]:
    """The TLS scrape settings dashboards/prometheus.yml shows in comments (after "Uncomment:"), parsed."""
    lines = SHIPPED_CONFIG.read_text().split("Uncomment:\n", 1)[1].splitlines()
    block = [line.split("# ", 1)[1] for line in lines if line.lstrip().startswith("# ") and "(security" not in line]
    return yaml.safe_load("\n".join(block))  # type: ignore[no-any-return]


@pytest.mark.live
def test_prometheus_scrapes_a_tls_run_with_its_ca_and_read_only_key(prometheus_binary: str, tmp_path: Path,
                                                                    tiny_model_dir: Path) -> None:
    """With security.tls=true, the shipped TLS settings (pointed at the run's CA and read-only key files) scrape
    every role; a job trusting another CA, and one without the key, scrape none."""
    from earl_stream.security.tls import run_ca_pem

    with RunningUp(tmp_path, tiny_model_dir, "security.tls=true") as up:
        up.wait_for_roles(ROLES, timeout_s=90)
        cfg = yaml.safe_load(_config(up.targets_file, tmp_path / "base.yml").read_text())
        (job,) = cfg["scrape_configs"]
        tls = _tls_block()
        assert tls["scheme"] == "https" and tls["authorization"]["type"] == "Bearer"
        tls["tls_config"]["ca_file"] = str(up.run_dir / "tls" / "ca.pem")
        tls["authorization"]["credentials_file"] = str(up.run_dir / "keys" / "readonly")
        job.update(tls)
        (tmp_path / "other_ca.pem").write_text(run_ca_pem(b"another cluster secret of 32 bytes"))
        wrong_ca = {**job, "job_name": "wrong_ca", "tls_config": {"ca_file": str(tmp_path / "other_ca.pem")}}
        no_key = {k: v for k, v in {**job, "job_name": "no_key"}.items() if k != "authorization"}
        cfg["scrape_configs"] = [job, wrong_ca, no_key]
        config = tmp_path / "prometheus.yml"
        config.write_text(yaml.safe_dump(cfg))
        with Prometheus(prometheus_binary, config, tmp_path) as prom:
            def logs() -> str:
                return f"--- prometheus ---\n{prom.log_tail()}\n--- up ---\n{up.log_tail()}"

            _poll("prometheus to be ready", prom.ready, 30, logs)

            def roles_up() -> set[str]:
                healthy = {r["metric"]["role"] for r in _query(prom.base, 'up{job="earl_stream"} == 1')}
                return healthy if set(ROLES) <= healthy else set()

            _poll("every role scraped over HTTPS with the read-only key", roles_up, 40, logs)
            _poll("a positive rollout token rate", lambda: _query(
                prom.base, 'sum(rate(earl_rollout_tokens_total{job="earl_stream"}[5s])) > 0'), 30, logs)
            for refused in ("wrong_ca", "no_key"):
                down = _poll(f"the {refused} job's targets scraped and down", lambda j=refused: _query(
                    prom.base, f'count(up{{job="{j}"}} == 0) >= {len(ROLES)}'), 30, logs)
                assert down
                assert not _query(prom.base, f'up{{job="{refused}"}} == 1')
