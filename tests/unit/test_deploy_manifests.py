"""examples/deploy/ against the schemas and tools that would reject it on a real cluster.

tests/unit/test_deploy_examples.py checks the deployments against Laminar (the config validates,
every ``laminar serve`` line names a real role and flags the CLI accepts); this file checks them
against Kubernetes, Bash and the Ray example's own command lines, offline:

* every manifest validates against the Kubernetes OpenAPI schema of the oldest and the newest
  version ``kubernetes-validate`` bundles, strictly (an unknown or misspelt field is an error, as
  ``kubectl apply`` with server-side field validation makes it);
* what a schema cannot see and ``kubectl apply`` would accept, leaving a broken deployment: a
  selector that does not match its pod template, a Service selecting no pods, a named port, a
  volume or a ``$(VAR)`` in a command that is not declared (Kubernetes passes an undeclared
  ``$(VAR)`` through literally), a StatefulSet's ``serviceName`` that is no Service;
* every Slurm script passes ``bash -n`` (``tests/integration/test_deploy_manifests.py``);
* the Ray example's commands parse with the CLI's own parser and its ``--set`` items load.
"""

from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from laminar.cli import build_parser
from laminar.roles_registry import builtin_roles
from laminar.runtime.config import load_config

kubernetes_validate = pytest.importorskip("kubernetes_validate.utils")

DEPLOY = Path(__file__).resolve().parents[2] / "examples" / "deploy"
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))
RAY_README = DEPLOY / "ray" / "README.md"
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")
VERSIONS = [kubernetes_validate.all_versions()[0], kubernetes_validate.latest_version()]


def _docs() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in MANIFESTS:
        out += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def _validate(doc: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_validates_against_the_kubernetes_schema(version: str) -> None:
    docs = _docs()
    assert {d["kind"] for _, d in docs} >= {"Namespace", "ConfigMap", "Service", *WORKLOADS}
    for name, doc in docs:
        try:
            _validate(doc, version)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(map(str, exc.path))
            pytest.fail(f"{name}: {doc['kind']} {doc['metadata']['name']}: {where}: {exc.message}")


def test_the_validator_rejects_a_wrong_type_and_an_unknown_field() -> None:
    """The check above can fail: a manifest with a mistake in it does not validate."""
    deployment = next(d for _, d in _docs() if d["kind"] == "Deployment")
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["replicas"] = "one"
    misspelt = copy.deepcopy(deployment)
    misspelt["spec"]["template"]["spec"]["containers"][0]["envFrom"][0]["secretRf"] = {"name": "x"}
    for bad in (wrong_type, misspelt):
        with pytest.raises(kubernetes_validate.ValidationError):
            _validate(bad, VERSIONS[-1])


def _pod(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]


def test_cross_references_that_no_schema_checks() -> None:
    docs = _docs()
    workloads = [(n, d) for n, d in docs if d["kind"] in WORKLOADS]
    services = {d["metadata"]["name"]: d for _, d in docs if d["kind"] == "Service"}
    pod_labels = [d["spec"]["template"]["metadata"]["labels"] for _, d in workloads]
    for name, doc in workloads:
        what = f"{name}: {doc['kind']} {doc['metadata']['name']}"
        labels = doc["spec"]["template"]["metadata"]["labels"]
        assert doc["spec"]["selector"]["matchLabels"].items() <= labels.items(), what
        if doc["kind"] == "StatefulSet":
            assert doc["spec"]["serviceName"] in services, what
        pod = _pod(doc)
        volumes = {v["name"] for v in pod.get("volumes", [])}
        volumes |= {t["metadata"]["name"] for t in doc["spec"].get("volumeClaimTemplates", [])}
        for c in pod["containers"]:
            ports = {p["name"] for p in c.get("ports", []) if "name" in p}
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                port = c.get(probe, {}).get("httpGet", {}).get("port")
                assert not isinstance(port, str) or port in ports, f"{what}: {probe} {port}"
            for mount in c.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{what}: {c['name']} mounts {mount['name']}"
            declared = {e["name"] for e in c.get("env", [])}
            for word in [*c.get("command", []), *c.get("args", [])]:
                for var in re.findall(r"\$\((\w+)\)", word):
                    assert var in declared, f"{what}: {c['name']}: $({var}) is not in its env"
    for name, svc in services.items():
        selector = svc["spec"].get("selector", {})
        assert any(selector.items() <= labels.items() for labels in pod_labels), name


def _ray_commands() -> list[list[str]]:
    """The README's shell lines (code blocks, continuations joined), split as a shell would."""
    blocks = re.findall(r"```bash\n(.*?)```", RAY_README.read_text(), re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True) for line in lines if line.strip()]


def test_the_ray_example_commands_parse_and_load() -> None:
    commands = [c for c in _ray_commands() if c]
    assert any(c[:3] == ["ray", "start", "--head"] for c in commands), commands
    runs = [c for c in commands if "laminar" in c]
    assert runs, commands
    for argv in runs:
        env = [w for w in argv[: argv.index("laminar")] if "=" in w]
        assert any(w.startswith("RAY_ADDRESS=") for w in env), argv
        args = build_parser().parse_args(argv[argv.index("laminar") + 1 :])
        assert args.command == "run" and args.launcher == "ray", argv
        config = load_config(DEPLOY.parents[1] / args.config, args.set)
        roles = {spec.role for spec in config.run.roles}
        assert roles == {"manager", "data", "trainer", "relay", "rollout"}, roles
        assert roles <= set(builtin_roles())
