"""The Grafana dashboard (dashboards/earl_stream.json) against a real run: it is Grafana-shaped JSON,
and every query of every panel names only metrics that a running `earl-stream up` exports, as read
over HTTP from every endpoint of the run's Prometheus targets file.

`RunningUp` (a background `up` that is stopped with SIGTERM and leaves no process behind) is also
used by test_prometheus.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

DASHBOARD = Path(__file__).resolve().parents[1] / "dashboards" / "earl_stream.json"
ROLES = ("supervisor", "rollout", "trainer")
# Series Prometheus itself adds for every target (not exported by a process).
PROMETHEUS_SYNTHETIC = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
PANEL_TYPES = {"row", "timeseries", "stat", "gauge", "bargauge", "table", "heatmap", "text"}
# Labelled by a plan, with no sample until an event sets one: a step that fails to allocate (which a healthy
# run never does), or a reserve learnt from measured peaks (CUDA peaks only under selector.learn_reserve=auto).
# For these, a process declaring the family (its `# TYPE` line, no sample yet) counts as exporting it.
EVENT_ONLY = {"earl_trainer_oom_recovered_total", "earl_selector_memory_correction",
              "earl_selector_memory_reserve_bytes"}


class RunningUp:
    """`earl-stream up --steps 0` (train until stopped) in the background, with the tiny model."""

    def __init__(self, tmp: Path, model_dir: Path, *overrides: str) -> None:
        self.run_dir = tmp / "run"
        self.targets_file = self.run_dir / "prometheus_targets.json"
        self.log_path = tmp / "up.log"
        self.cmd = [sys.executable, "-m", "earl_stream", "up", "--steps", "0", "--summary", str(tmp / "summary.json"),
                    f"model.path={model_dir}", f"run_dir={self.run_dir}", "trainer.groups_per_step=2",
                    "trainer.group_size=4", "rollout.groups_in_flight=2", "supervisor.heartbeat_s=0.2", *overrides]
        self.proc: subprocess.Popen | None = None
        self.seen: set[str] = set()

    def __enter__(self) -> RunningUp:
        with open(self.log_path, "wb") as log:
            # Own session: a stray Ctrl-C in the terminal running pytest does not reach it.
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, n: int = 30) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        return "\n".join(lines[-n:])

    def targets(self) -> dict[str, str]:
        """{"host:port": role} from the targets file `up` keeps current (empty until it exists)."""
        if not self.targets_file.exists():
            return {}
        groups = json.loads(self.targets_file.read_text())  # replaced atomically by `up`
        found = {t: g["labels"]["role"] for g in groups for t in g["targets"]}
        self.seen.update(found)
        return found

    def wait_for_roles(self, roles: tuple[str, ...] = ROLES, timeout_s: float = 60) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, f"`up` exited early:\n{self.log_tail()}"
            found = self.targets()
            if set(roles) <= set(found.values()):
                return found
            time.sleep(0.2)
        raise AssertionError(f"targets file never listed every role {roles}: {self.targets()}\n{self.log_tail()}")

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERM `up` (it stops its children), then check that no endpoint of the run still answers."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired as exc:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the group we created; children die with their parent
                self.proc.wait(10)
                raise AssertionError(f"`up` ignored SIGTERM for {timeout_s}s\n{self.log_tail()}") from exc
        deadline = time.monotonic() + 10
        alive = set(self.seen)
        while alive and time.monotonic() < deadline:
            alive = {a for a in alive if _answers(a)}
            time.sleep(0.2)
        assert not alive, f"processes of the run still serve metrics after `up` stopped: {sorted(alive)}"


def _answers(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return True
    except OSError:
        return False


def scrape(address: str) -> dict[str, list[dict[str, str]]]:
    """Sample names -> label sets of one endpoint's /metrics (histograms as _bucket/_sum/_count)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    samples: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(dict(s.labels))
        # declared, no sample yet (a labelled family no event has set): only the EVENT_ONLY names count
        declared = family.name + "_total" if family.type == "counter" else family.name
        if not family.samples and declared in EVENT_ONLY:
            samples.setdefault(declared, [])
    return samples


# --- PromQL: the metric names a query selects ---------------------------------------------------

_STRINGS = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\[\]]*\]")
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
# Not preceded by a word char, '.', ':' or '$': skips the "m" of 5m, the "e3" of 1e3, Grafana's $vars.
_IDENT = re.compile(r"(?<![\w.:$])([A-Za-z_:][\w:]*)(\s*\()?")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset",
             "inf", "nan", "Inf", "NaN"}


def metric_names(expr: str) -> set[str]:
    """Metric names selected by a PromQL expression: functions, aggregations, label matchers, label
    lists, ranges, keywords, numbers and durations are not metric names."""
    text = _STRINGS.sub('""', expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGES.sub(" ", text)
    text = _LABEL_LISTS.sub(" ", text)
    assert "__name__" not in text, f"select metrics by name, not by __name__: {expr}"
    return {m.group(1) for m in _IDENT.finditer(text) if not m.group(2) and m.group(1) not in _KEYWORDS}


@pytest.mark.parametrize("expr, names", [
    ('sum by (worker) (rate(earl_rollout_tokens_total{worker=~"r.*"}[1m]))', {"earl_rollout_tokens_total"}),
    ('histogram_quantile(0.9, sum by (le) (rate(x_seconds_bucket[5m:1m])))', {"x_seconds_bucket"}),
    ('sum by (env, outcome) (rate(a_total[5m])) / ignoring(outcome) group_left sum by (env) (rate(a_total[5m]))',
     {"a_total"}),
    ('scalar(max(v{role="supervisor"})) - w offset 5m > bool 1e3', {"v", "w"}),
    ('rate(c_total[$__rate_interval]) and on(rank) d{q="{not_a_metric}"}', {"c_total", "d"}),
    ('sum(rate(s_sum[1m])) by (le) / sum without (rank) (rate(s_count[1m]))', {"s_sum", "s_count"}),
])
def test_metric_names_parser(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


# --- the dashboard -------------------------------------------------------------------------------

def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # collapsed rows hold their panels


def _queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, expr) of every panel target and every Prometheus annotation."""
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            yield f"panel {panel['id']} {panel['title']!r} target {target['refId']}", target["expr"]
    for ann in dashboard.get("annotations", {}).get("list", []):
        if ann.get("expr"):
            yield f"annotation {ann['name']!r}", ann["expr"]


def test_dashboard_is_grafana_shaped() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    for key in ("title", "uid", "schemaVersion", "panels", "time", "annotations", "templating"):
        assert key in dashboard, key
    inputs = {i["name"]: i for i in dashboard["__inputs"]}
    assert inputs["DS_PROMETHEUS"]["type"] == "datasource" and inputs["DS_PROMETHEUS"]["pluginId"] == "prometheus"
    ids = [p["id"] for p in _panels(dashboard)]
    assert all(isinstance(i, int) for i in ids) and len(ids) == len(set(ids)), "panel ids must be unique integers"
    cells: set[tuple[int, int]] = set()
    for panel in _panels(dashboard):
        where = f"panel {panel['id']}"
        assert panel["title"] and panel["type"] in PANEL_TYPES, where
        g = panel["gridPos"]
        assert g["w"] > 0 and g["h"] > 0 and 0 <= g["x"] and g["x"] + g["w"] <= 24, where
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{where} overlaps another panel"
        cells |= mine
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, where
        targets = panel["targets"]
        assert targets, f"{where} has no queries"
        ref_ids = [t["refId"] for t in targets]
        assert len(ref_ids) == len(set(ref_ids)), f"{where}: duplicate refId"
        for t in targets:
            assert t["expr"].strip() and t["datasource"]["uid"] == "${DS_PROMETHEUS}", where
            assert metric_names(t["expr"]), f"{where}: {t['expr']!r} selects no metric"


def _wait_for_exports(up: RunningUp, wanted: set[str], timeout_s: float) -> tuple[dict[str, set[str]], set[str]]:
    """Scrape every endpoint of the run until it has trained, and `wanted` is exported or time is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        by_role: dict[str, set[str]] = {}
        for address, role in up.wait_for_roles().items():
            by_role.setdefault(role, set()).update(scrape(address))
        exported = set().union(*by_role.values())
        trained = "earl_trainer_steps_total" in by_role.get("trainer", set())
        if (trained and wanted <= exported | PROMETHEUS_SYNTHETIC) or time.monotonic() > deadline:
            return by_role, exported
        time.sleep(0.5)


def test_every_dashboard_query_names_exported_metrics(tmp_path: Path, tiny_model_dir: Path) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = list(_queries(dashboard))
    wanted = set().union(*(metric_names(expr) for _, expr in queries))
    # evaluation during training (the Evaluation row): a held-out environment evaluated at every version,
    # never trained (weight 0), beside the trained Tic-Tac-Toe
    parity = Path(__file__).resolve().parent / "evaluation" / "parity_env.py"
    with RunningUp(tmp_path, tiny_model_dir, "rollout.workers=1", f"envs.1.spec={parity}:ParityEnv", "envs.1.name=parity",
                   "envs.1.weight=0", "eval.every=1", "eval.envs=[parity]", "eval.problems=2") as up:
        by_role, exported = _wait_for_exports(up, wanted, timeout_s=120)
        log = up.log_tail()
    assert set(ROLES) <= set(by_role), by_role.keys()
    for role in ROLES:  # every process serves the Python process metrics the health panels use
        assert "process_resident_memory_bytes" in by_role[role], role
    missing = [f"{where}: {sorted(metric_names(expr) - exported - PROMETHEUS_SYNTHETIC)} in {expr!r}"
               for where, expr in queries if metric_names(expr) - exported - PROMETHEUS_SYNTHETIC]
    assert not missing, "queries name metrics the running system does not export:\n" + "\n".join(missing) + \
        f"\nexported: {sorted(n for n in exported if n.startswith('earl_'))}\n{log}"
