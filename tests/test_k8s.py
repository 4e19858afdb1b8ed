"""deploy/k8s rendered and checked without a cluster (none runs here): every manifest parses, the
kustomization resolves (with `kubectl kustomize` where installed, else by this test reading the
resources and generators itself), every reference (ConfigMap, Secret, claim, Service selector, the
supervisor address) names a rendered object, every command is a real `earl-stream` subcommand that the
CLI parses, and the dashboard ConfigMap holds dashboards/earl_stream.json."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from earl_stream.cli.main import build_parser
from earl_stream.config import load_config

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"


def _resolve_by_hand() -> list[dict[str, Any]]:
    """What `kustomize build` yields, minus name hashes: resources, generated ConfigMaps, namespace, labels."""
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    docs = [d for r in kust["resources"] for d in yaml.safe_load_all((K8S / r).read_text()) if d]
    for gen in kust.get("configMapGenerator", []):
        data = {Path(f).name: (K8S / f).read_text() for f in gen["files"]}
        labels = gen.get("options", {}).get("labels", {})
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"], "labels": labels},
                     "data": data})
    for d in docs:
        if d["kind"] != "Namespace":
            d["metadata"]["namespace"] = kust["namespace"]
    return docs


def _rendered() -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return _resolve_by_hand()
    out = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=120, check=True)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _base(name: str) -> str:
    """A generated name without kustomize's hash suffix (earl-stream-config-9f9mdtkm5f -> earl-stream-config)."""
    head, _, tail = name.rpartition("-")
    return head if head and len(tail) == 10 and tail.isalnum() and not tail.isalpha() else name


def _pods(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d["spec"]["template"] for d in docs if d["kind"] in ("Deployment", "Job")}


def test_every_manifest_parses() -> None:
    files = sorted(K8S.glob("*.yaml"))
    assert len(files) >= 7
    for f in files:
        assert list(yaml.safe_load_all(f.read_text())), f
    # the run's config is a valid earl_stream config
    assert load_config(K8S / "run.yaml").model.path == "/data/model"


@pytest.mark.parametrize("render", [_rendered, _resolve_by_hand], ids=["kustomize", "by-hand"])
def test_rendered_objects_and_references(render: Any) -> None:
    docs = render()
    by_kind: dict[str, set[str]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], set()).add(_base(d["metadata"]["name"]))
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == "earl-stream"
    assert {"earl-stream-supervisor", "earl-stream-rollout"} <= by_kind["Deployment"]
    assert {"earl-stream-supervisor", "earl-stream-trainer"} <= by_kind["Service"]
    assert by_kind["Job"] == {"earl-stream-trainer"} and by_kind["Secret"] == {"earl-stream-secret", "earl-stream-worker-key"}
    assert {"earl-stream-config", "earl-stream-grafana-dashboard"} <= by_kind["ConfigMap"]
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    job = next(d for d in docs if d["kind"] == "Job")
    assert job["spec"]["completionMode"] == "Indexed"
    pods = _pods(docs)
    for name, pod in pods.items():
        annotations = pod["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true", name
        for vol in pod["spec"]["volumes"]:
            ref = (("ConfigMap", vol["configMap"]["name"]) if "configMap" in vol else
                   ("Secret", vol["secret"]["secretName"]) if "secret" in vol else
                   ("PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"]))
            assert ref in names, f"{name} mounts {ref}, which is not rendered"
        for c in pod["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert env["EARL_STREAM_METRICS_PORT"] == annotations["prometheus.io/port"], name
            assert env["EARL_STREAM_SECRET_FILE"].startswith(
                next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "secret"))
        # only the supervisor holds the cluster secret; workers get the worker key (security/keys.py)
        secrets = {v["secret"]["secretName"] for v in pod["spec"]["volumes"] if "secret" in v}
        assert secrets == ({"earl-stream-secret"} if "supervisor" in name else {"earl-stream-worker-key"}), name
    for svc in (d for d in docs if d["kind"] == "Service"):
        selector = svc["spec"]["selector"]
        assert any(selector.items() <= pod["metadata"]["labels"].items() for pod in pods.values()), svc["metadata"]


def _earl_args(container: dict[str, Any]) -> list[str]:
    """The earl-stream arguments a container runs (after torchrun's --no-python), $(VARS) filled in."""
    argv = [*container["command"], *container["args"]]
    argv = [a.replace("$(POD_IP)", "10.0.0.7").replace("$(NODE_RANK)", "0") for a in argv]
    if argv[0] == "torchrun":
        assert "--no-python" in argv, "torchrun must run the earl-stream script, not python"
        argv = argv[argv.index("--no-python") + 1:]
    assert argv[0] == "earl-stream", shlex.join(argv)
    return argv[1:]


def test_commands_are_real_entry_points() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'earl-stream = "earl_stream.cli.main:main"' in pyproject
    docs = _resolve_by_hand()
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "earl-stream-supervisor")
    control = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "control")
    parser = build_parser()
    roles = {}
    for name, pod in _pods(docs).items():
        for c in pod["spec"]["containers"]:
            args = parser.parse_args(_earl_args(c))
            roles[name] = args.command if args.command != "worker" else args.role
            if args.command == "worker":
                assert args.supervisor == f"tcp://earl-stream-supervisor:{control}", name
                if args.role == "rollout":  # scale-down drains: nothing lost, within the grace period
                    assert args.drain_on_term and pod["spec"]["terminationGracePeriodSeconds"] >= 300
            else:
                assert args.bind.endswith(f":{control}") and args.config.startswith("/etc/earl-stream/")
    assert roles == {"earl-stream-supervisor": "supervisor", "earl-stream-rollout": "rollout",
                     "earl-stream-trainer": "trainer"}


def test_dashboard_configmap_is_the_repositorys_dashboard() -> None:
    copy = (K8S / "dashboards" / "earl_stream.json").read_text()
    assert json.loads(copy) == json.loads((ROOT / "dashboards" / "earl_stream.json").read_text()), (
        "deploy/k8s/dashboards/earl_stream.json is stale: cp dashboards/earl_stream.json deploy/k8s/dashboards/")
    cm = next(d for d in _rendered() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "earl-stream-grafana-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["earl_stream.json"])["title"] == json.loads(copy)["title"]
