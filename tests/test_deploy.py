"""The deployment files name real things: entry points, flags the real parsers accept, ports, probes
and secrets that exist. No Docker engine or Kubernetes cluster here: the files are parsed and checked
against the code."""
from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml
from sqlalchemy.engine import make_url

from coordinator import cli as coordinator_cli
from coordinator.auth import required
from node import cli as node_cli

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def manifests() -> dict[tuple[str, str], dict]:
    found = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and "kind" in doc and doc["kind"] != "Kustomization" and "apiVersion" in doc:
                found[(doc["kind"], doc["metadata"]["name"])] = doc
    return found


def containers(docs: dict) -> dict[str, dict]:
    return {c["name"]: (c, doc) for doc in docs.values() if doc["kind"] in ("Deployment", "StatefulSet")
            for c in doc["spec"]["template"]["spec"]["containers"]}


def substituted(arg: str) -> str:
    """$(VAR) as Kubernetes expands it, with a stand-in value."""
    return re.sub(r"\$\((\w+)\)", lambda m: m[1].lower(), arg)


def port_number(container: dict, port) -> int:
    return port if isinstance(port, int) else next(p["containerPort"] for p in container["ports"] if p["name"] == port)


def test_kustomization_lists_every_manifest_but_the_secret_example():
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in K8S.glob("*.yaml")
                                    if p.name not in ("kustomization.yaml", "secrets.example.yaml"))


def test_our_containers_run_real_entry_points_with_flags_the_parsers_accept(monkeypatch):
    docs = manifests()
    ours = {name: (c, doc) for name, (c, doc) in containers(docs).items() if c["image"].startswith("ravnest")}
    assert set(ours) == {"coordinator", "node"}
    for name, (container, _) in ours.items():
        [entry] = container["command"]
        assert entry in SCRIPTS, entry
        args = [substituted(a) for a in container["args"]]
        for variable in ("RAVNEST_OPERATOR_TOKEN", "RAVNEST_JOIN_TOKEN", "RAVNEST_DB"):
            monkeypatch.setenv(variable, f"from-{variable}")
        parsed = (coordinator_cli.parse_args(args) if entry == "ravnest-coordinator"
                  else node_cli._parser().parse_args(args))
        env = {e["name"] for e in container.get("env", [])}
        if entry == "ravnest-coordinator":
            # the secrets reach the coordinator through the variables its options read
            assert {"RAVNEST_OPERATOR_TOKEN", "RAVNEST_JOIN_TOKEN", "RAVNEST_DB"} <= env
            assert parsed.operator_token == "from-RAVNEST_OPERATOR_TOKEN" and parsed.db == "from-RAVNEST_DB"
            assert port_number(container, "http") == parsed.port
        else:
            assert "RAVNEST_JOIN_TOKEN" in env and parsed.token == "from-RAVNEST_JOIN_TOKEN"
            assert port_number(container, "grpc") == parsed.port
            assert port_number(container, "metrics") == parsed.metrics_port
            assert parsed.coordinator == "http://ravnest-coordinator:8470"


def test_probes_services_and_secrets_point_at_what_exists():
    docs = manifests()
    coordinator, _ = containers(docs)["coordinator"]
    for probe in ("readinessProbe", "livenessProbe"):
        check = coordinator[probe]["httpGet"]
        assert check["path"] == "/healthz" and required("GET", "/healthz") == "open"  # probes carry no token
        assert port_number(coordinator, check["port"]) == 8470
    for (kind, name), doc in docs.items():
        if kind != "Service":
            continue
        targets = [c for c, owner in containers(docs).values()
                   if owner["spec"]["template"]["metadata"]["labels"] == doc["spec"]["selector"]]
        assert targets, f"Service {name} selects no pod"
        for port in doc["spec"]["ports"]:
            assert port_number(targets[0], port["targetPort"]) == port["port"], (name, port)
    secret = yaml.safe_load((K8S / "secrets.example.yaml").read_text())
    for container, _ in containers(docs).values():
        for variable in container.get("env", []):
            ref = variable.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"], ref
    database = make_url(substituted(next(e["value"] for e in coordinator["env"] if e["name"] == "RAVNEST_DB")))
    assert database.drivername == "postgresql+psycopg" and ("Service", database.host) in docs
    postgres = docs[("StatefulSet", "ravnest-postgres")]
    assert postgres["spec"]["volumeClaimTemplates"] and database.port == 5432
    coordinators = docs[("Deployment", "ravnest-coordinator")]["spec"]
    assert coordinators["replicas"] >= 2  # several processes on one store: one may die
    [claim] = [v["persistentVolumeClaim"]["claimName"] for v in coordinators["template"]["spec"]["volumes"]]
    assert docs[("PersistentVolumeClaim", claim)]["spec"]["accessModes"] == ["ReadWriteMany"]  # both see uploads


@pytest.mark.parametrize("compose_service", ["coordinator-a", "coordinator-b", "node"])
def test_compose_and_the_image_run_real_entry_points(compose_service):
    compose = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())
    coordinators = [name for name in compose["services"] if name.startswith("coordinator")]
    assert len(coordinators) >= 2 and all(f"http://{name}:8470" in compose["services"]["node"]["command"][2]
                                          for name in coordinators)  # nodes are given every coordinator
    command = compose["services"][compose_service]["command"]
    words = shlex.split(command[2]) if command[0] == "sh" else command
    assert words[0] in SCRIPTS
    assert "RAVNEST_JOIN_TOKEN" in compose["services"][compose_service]["environment"]
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert re.search(r"^ARG TORCH_INDEX=cpu$", dockerfile, re.MULTILINE)  # --build-arg TORCH_INDEX=cu126: CUDA
    assert re.search(r'^CMD \["ravnest-coordinator"', dockerfile, re.MULTILINE)
    assert set(re.search(r"^EXPOSE (.*)$", dockerfile, re.MULTILINE)[1].split()) == {"8470", "8471", "9471"}
