"""`earl-stream doctor`: real checks of this machine (torch and CUDA, packages imported, ports bound, /dev/shm,
the model folder or Hub cache), exit 1 exactly when a run of the given config cannot start here."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from earl_stream.cli.main import main

NAMES = ["torch", "trainer.device", "rollout.device", "vLLM", "SGLang", "UCX (ucxx)", "Ray", "ports", "/dev/shm",
         "model", "run_dir", "sandbox"]


def _doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    code = main(["doctor", "--json", *args])
    return code, json.loads(capsys.readouterr().out)


def _by_name(report: dict) -> dict[str, dict]:
    return {f["name"]: f for f in report["findings"]}


def _names(names: list[str]) -> list[str]:
    """The findings every machine reports (a machine with GPUs adds one `GPU i` line each)."""
    return [n for n in names if not n.startswith("GPU ")]


def test_the_default_run_can_start_here(tmp_path: Path) -> None:
    """The real command line: one line per finding, every missing thing with its fix, exit 0."""
    proc = subprocess.run([sys.executable, "-m", "earl_stream", "doctor", f"run_dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == "a run of this config can start here"
    assert _names([line.split("] ", 1)[1].split(":", 1)[0] for line in lines[:-1]]) == NAMES
    assert all("-> fix: " in line for line in lines if line.startswith("[warn]"))
    assert torch.__version__ in lines[0]


def test_json_report_and_what_is_installed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, report = _doctor(capsys, f"run_dir={tmp_path}")
    assert code == 0 and report["can_start"] is True
    found = _by_name(report)
    assert _names(list(found)) == NAMES
    for name, module in (("vLLM", "vllm"), ("SGLang", "sglang"), ("UCX (ucxx)", "ucxx"), ("Ray", "ray")):
        try:
            __import__(module)
            importable = True
        except ImportError:
            importable = False
        assert (found[name]["verdict"] == "ok") == importable, found[name]
        assert importable or "pip install" in found[name]["fix"]
    gpus = [n for n in found if n.startswith("GPU ")]  # each GPU with its memory
    assert len(gpus) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert all("GiB free" in found[n]["detail"] for n in gpus)
    assert found["ports"]["verdict"] == "ok" and found["/dev/shm"]["verdict"] in ("ok", "warn")


def test_a_device_this_machine_lacks_fails(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():  # more ranks on this host than GPUs: NCCL refuses it
        args = ["trainer.device=cuda", f"trainer.nproc={torch.cuda.device_count() + 1}"]
    else:
        args = ["trainer.device=cuda"]
    code, report = _doctor(capsys, *args)
    assert code == 1 and report["can_start"] is False
    fail = _by_name(report)["trainer.device"]
    assert fail["verdict"] == "fail" and fail["fix"]


def test_the_model_path_must_resolve(tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    code, report = _doctor(capsys, f"model.path={tmp_path / 'nope'}")
    assert code == 1 and _by_name(report)["model"]["verdict"] == "fail"
    assert "init-model" in _by_name(report)["model"]["fix"]
    (tmp_path / "empty").mkdir()
    code, report = _doctor(capsys, f"model.path={tmp_path / 'empty'}")
    assert code == 1 and "no config.json" in _by_name(report)["model"]["detail"]
    code, report = _doctor(capsys, f"model.path={tiny_model_dir}")
    model = _by_name(report)["model"]
    assert code == 0 and model["verdict"] == "ok" and "qwen" in model["detail"].lower()
    # a Hub id this host's cache does not hold, offline: the run could not get it
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    code, report = _doctor(capsys, "model.path=earl-stream-tests/no-such-model")
    model = _by_name(report)["model"]
    assert code == 1 and model["verdict"] == "fail" and "hf download earl-stream-tests/no-such-model" in model["fix"]


def test_a_needed_package_that_does_not_import_fails(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        import ray  # noqa: F401
        pytest.skip("ray is installed here")
    except ImportError:
        pass
    code, report = _doctor(capsys, "launcher.kind=ray")
    ray_finding = _by_name(report)["Ray"]
    assert code == 1 and ray_finding["verdict"] == "fail" and "earl_stream[ray]" in ray_finding["fix"]


def test_a_taken_port_and_a_small_shm_warn_and_a_bad_config_fails(capsys: pytest.CaptureFixture[str]) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        code, report = _doctor(capsys, f"rollout.openai_bind=127.0.0.1:{port}", f"store.max_bytes_per_node={1 << 50}")
    finally:
        taken.close()
    found = _by_name(report)
    assert code == 0  # the run starts; its OpenAI endpoint and shared memory would not
    assert found["rollout.openai_bind"]["verdict"] == "warn" and str(port) in found["rollout.openai_bind"]["detail"]
    assert found["/dev/shm"]["verdict"] == "warn" and "--shm-size" in found["/dev/shm"]["fix"]
    code, report = _doctor(capsys, "rollout.workerz=2")
    config = _by_name(report)["config"]
    assert code == 1 and config["verdict"] == "fail" and "rollout.workerz" in config["detail"]
    assert "\n" not in config["detail"] and _names(list(_by_name(report))[1:]) == NAMES  # the machine is still checked


def test_help_explains(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["doctor", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Exit status 1 when a run of this config cannot start here" in text and "--json" in text


def test_the_sandbox_finding_says_whether_bwrap_works(capsys: pytest.CaptureFixture[str]) -> None:
    from earl_stream.sandbox import bwrap_problem

    _, report = _doctor(capsys)
    sandbox = _by_name(report)["sandbox"]
    if bwrap_problem() is None:
        assert sandbox["verdict"] == "ok" and "bubblewrap can make its namespaces" in sandbox["detail"]
    else:
        assert sandbox["verdict"] == "warn" and sandbox["fix"] == "bash scripts/install-sandbox.sh (as root)"
