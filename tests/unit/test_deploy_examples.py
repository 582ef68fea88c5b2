"""The deployment examples (examples/deploy/) stay valid against the code they deploy.

Nobody runs a Kubernetes cluster or Slurm in CI, so what can drift is checked statically: every
YAML parses, the cluster config validates with Laminar's own loader and each role's config model
(with the per-process ``--set`` overrides the manifests and the script add), the ConfigMap holds
the same config, and every ``laminar serve`` command line names a real role and only flags the
``serve`` parser knows.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from laminar.cli import build_parser
from laminar.roles_registry import builtin_roles, load_role
from laminar.runtime.config import load_config

DEPLOY = Path(__file__).resolve().parents[2] / "examples" / "deploy"
CLUSTER = DEPLOY / "cluster.yaml"
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))
SBATCH = DEPLOY / "slurm" / "laminar.sbatch"
ROLES = ("manager", "data", "relay", "trainer", "rollout")


def _manifest_commands() -> list[list[str]]:
    out = []
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            spec = (doc or {}).get("spec", {}).get("template", {}).get("spec", {})
            for c in spec.get("containers", []):
                argv = [*c.get("command", []), *c.get("args", [])]
                if argv[:2] == ["laminar", "serve"]:
                    out.append(argv)
    return out


def _sbatch_commands() -> list[list[str]]:
    """Each `laminar serve ...` of the script, continuation lines joined, shell syntax cut off."""
    text = SBATCH.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        if line.lstrip().startswith("#") or "laminar serve" not in line:
            continue
        words = shlex.split(line[line.index("laminar serve") :], comments=True)
        out.append(words)
    return out


def test_every_yaml_parses() -> None:
    assert MANIFESTS, "no manifests found"
    for path in [CLUSTER, *MANIFESTS]:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs, f"{path} is empty"
        for doc in docs:
            if path.parent.name == "k8s":
                assert {"apiVersion", "kind", "metadata"} <= doc.keys(), path


def test_cluster_config_validates_for_every_role() -> None:
    config = load_config(CLUSTER)
    for role in ROLES:
        model = load_role(role).config_model
        config.role_config(role, model)  # raises ConfigError naming the key on a problem


def test_configmap_holds_the_cluster_config() -> None:
    (cm,) = yaml.safe_load_all((DEPLOY / "k8s" / "02-configmap.yaml").read_text())
    assert cm["data"]["cluster.yaml"] == CLUSTER.read_text()


@pytest.mark.parametrize("source", ["k8s", "slurm"])
def test_serve_command_lines_are_valid(source: str) -> None:
    commands = _manifest_commands() if source == "k8s" else _sbatch_commands()
    parser = build_parser()
    roles_seen = set()
    for argv in commands:
        # argparse exits on an unknown flag or a missing --role
        args = parser.parse_args(argv[1:])
        assert args.command == "serve"
        assert args.role in builtin_roles(), f"unknown role in {argv}"
        roles_seen.add(args.role)
        assert args.role == "manager" or args.join, f"{argv} does not join the manager"
        # the overrides apply to the config and still validate (placeholders filled in)
        sets = [re.sub(r"\$\(.*\)|\$\w+|\$\{\w+\}", "10.0.0.1", s) for s in args.set]
        section = args.section or args.role
        load_config(CLUSTER, sets).role_config(section, load_role(args.role).config_model)
    assert roles_seen == set(ROLES), f"{source}: roles started: {sorted(roles_seen)}"


def test_no_manifest_carries_a_token_and_every_role_reads_the_one_secret() -> None:
    """`kubectl apply -f examples/deploy/k8s/` must not install a placeholder token: the token's
    Secret is made by hand (the docs and 00-namespace.yaml say how), and every container takes
    it from that Secret."""
    refs = set()
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is None:
                continue
            assert doc["kind"] != "Secret", f"{path.name}: a Secret in the applied directory"
            spec = doc.get("spec", {}).get("template", {}).get("spec", {})
            for c in spec.get("containers", []):
                argv = [*c.get("command", []), *c.get("args", [])]
                if argv[:2] == ["laminar", "serve"]:
                    assert "LAMINAR_TOKEN" not in {e["name"] for e in c.get("env", [])}, path
                    refs |= {e["secretRef"]["name"] for e in c.get("envFrom", [])}
    assert refs == {"laminar-token"}
    create = "kubectl -n laminar create secret generic laminar-token"
    docs = DEPLOY.parents[1] / "docs" / "deploy.md"
    for where in (docs, DEPLOY / "k8s" / "00-namespace.yaml"):
        text = where.read_text().replace("\\\n", " ")
        assert create in text and "secrets.token_hex(16)" in text, where


def test_the_slurm_script_makes_its_files_private_before_it_writes_them() -> None:
    lines = [line.strip() for line in SBATCH.read_text().splitlines()]
    first_write = min(i for i, line in enumerate(lines) if line.startswith(("mkdir", "echo")))
    assert "umask 077" in lines[:first_write]
