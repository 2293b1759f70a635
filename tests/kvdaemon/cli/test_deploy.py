"""The files in deploy/: the systemd unit (``systemd-analyze verify`` where installed), the
Dockerfile, and the Kubernetes manifests (checked against the Kubernetes schemas by
kubernetes-validate where installed, and for what kvdaemon needs in any case)."""

from __future__ import annotations

import configparser
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from kvdaemon.cli.commands import main
from kvdaemon.daemon.config import load_config, tomllib

REPO = Path(__file__).resolve().parents[3]
DEPLOY = REPO / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
SCRIPT = Path(sys.executable).parent / "kvdaemon"


def unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(DEPLOY / "kvdaemon.service")
    return parser


def test_the_unit_is_a_notify_service_with_a_graceful_stop() -> None:
    service = unit()["Service"]
    assert service["Type"] == "notify"
    assert service["RuntimeDirectory"] == "kvdaemon"
    assert service["RuntimeDirectoryMode"] == "0700"  # the daemon refuses anything else
    assert service["Environment"] == "KVDAEMON_DIR=/run/kvdaemon"
    assert service["Restart"] == "on-failure"
    start, stop = service["ExecStart"].split(), service["ExecStop"].split()
    assert start[1:3] == ["start", "--foreground"]  # systemd waits for READY=1 from this pid
    assert stop[1:2] == ["stop"] and Path(stop[0]).name == "kvdaemon"
    assert "--config" in start and start[start.index("--config") + 1] == "/etc/kvdaemon/kvdaemon.toml"
    assert unit()["Install"]["WantedBy"] == "multi-user.target"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify_accepts_the_unit() -> None:
    text = (DEPLOY / "kvdaemon.service").read_text()
    with tempfile.TemporaryDirectory() as tmp:
        # ExecStart must name an executable here: this install's script stands in for
        # /usr/local/bin/kvdaemon; nothing else changes.
        path = Path(tmp) / "kvdaemon.service"
        path.write_text(text.replace("/usr/local/bin/kvdaemon", str(SCRIPT)))
        done = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True,
                              text=True, timeout=120)  # fmt: skip
    assert (done.returncode, done.stderr.strip()) == (0, ""), done.stderr  # warnings too


def dockerfile() -> list[tuple[str, str]]:
    """The Dockerfile's instructions as (KEYWORD, arguments), continuations joined."""
    text = re.sub(r"\\\n\s*", " ", (DEPLOY / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def test_the_container_runs_the_daemon_as_its_entry_process_on_a_cuda_base() -> None:
    steps = dockerfile()
    keywords = [keyword for keyword, _ in steps]
    assert steps[0][0] == "FROM" and steps[0][1].startswith("nvidia/cuda:")
    args = dict(steps)
    assert json.loads(args["ENTRYPOINT"]) == ["kvdaemon", "start", "--foreground"]  # exec form
    assert args["STOPSIGNAL"] == "SIGTERM"
    assert args["USER"] != "root" and not args["USER"].startswith("0")
    assert keywords.count("ENTRYPOINT") == 1 and "EXPOSE" in keywords
    assert json.loads(args["CMD"]) == ["--metrics-address", "0.0.0.0:9400"]


def test_the_container_installs_what_the_daemon_imports_and_no_torch() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = {req for req in project["dependencies"] if not req.startswith(("torch", "tomli"))}
    wanted |= set(project["optional-dependencies"]["cuda"])
    run = " ".join(arguments for keyword, arguments in dockerfile() if keyword == "RUN")
    installed = set(re.findall(r'"([A-Za-z0-9_.-]+[<>=!~][^"]*)"', run))
    assert installed == wanted


def manifests() -> dict[str, dict[str, Any]]:
    yaml = pytest.importorskip("yaml")
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(KUBERNETES.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            found[document["kind"]] = document
    return found


def test_kubernetes_manifests_pass_the_kubernetes_schemas() -> None:
    validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed")
    for kind, document in manifests().items():
        validate.validate(document, validate.latest_version(), strict=True)  # raises if invalid
        assert document["metadata"]["name"], kind


def test_the_daemonset_shares_its_directory_and_uid_with_the_serving_pod() -> None:
    found = manifests()
    assert set(found) == {"Namespace", "ConfigMap", "DaemonSet", "Pod"}
    pod_spec = found["DaemonSet"]["spec"]["template"]["spec"]
    (daemon,) = pod_spec["containers"]
    serving = found["Pod"]["spec"]["containers"][0]

    def env(container: dict[str, Any]) -> dict[str, str]:
        return {item["name"]: item["value"] for item in container["env"]}

    def host_path(spec: dict[str, Any], container: dict[str, Any], directory: str) -> str:
        (mount,) = [m for m in container["volumeMounts"] if directory.startswith(m["mountPath"])]
        (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        return volume["hostPath"]["path"] + directory[len(mount["mountPath"]):]

    directory = env(daemon)["KVDAEMON_DIR"]
    assert env(serving)["KVDAEMON_DIR"] == directory
    assert host_path(pod_spec, daemon, directory) == host_path(found["Pod"]["spec"], serving, directory)
    assert daemon["securityContext"]["runAsUser"] == serving["securityContext"]["runAsUser"]
    assert pod_spec["hostPID"] is True  # it sees the serving pods' pids (it refuses those it cannot)
    (init,) = pod_spec["initContainers"]
    assert init["command"][-1] == directory  # created 0700 for the daemon's uid
    assert str(daemon["securityContext"]["runAsUser"]) in init["command"]
    assert "nvidia.com/gpu" in serving["resources"]["limits"]
    assert "nvidia.com/gpu" not in daemon["resources"].get("limits", {})  # the GPU stays free
    assert daemon["resources"]["requests"]["cpu"] and daemon["resources"]["requests"]["memory"]


def test_prometheus_scrapes_the_port_the_configmap_serves_on(tmp_path: Path) -> None:
    found = manifests()
    config_file = tmp_path / "kvdaemon.toml"
    config_file.write_text(found["ConfigMap"]["data"]["kvdaemon.toml"])
    config = load_config({}, {}, config_file)
    template = found["DaemonSet"]["spec"]["template"]
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == config.metrics_port
    assert annotations["prometheus.io/path"] == "/metrics"
    assert config.metrics_host == "0.0.0.0"  # reachable from the pod network
    (daemon,) = template["spec"]["containers"]
    assert [p["containerPort"] for p in daemon["ports"]] == [config.metrics_port]
    assert daemon["readinessProbe"]["httpGet"]["path"] == "/healthz"
    probe = daemon["livenessProbe"]["exec"]["command"]
    assert probe[0] == "kvdaemon" and probe[1] in main.commands


def test_the_example_config_and_logrotate_rules_exist() -> None:
    assert (DEPLOY / "kvdaemon.toml").is_file()
    rules = (DEPLOY / "kvdaemon.logrotate").read_text()
    assert "create 0600" in rules and "HUP" in rules
