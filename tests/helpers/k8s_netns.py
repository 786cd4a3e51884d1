"""Run a rendered deploy/k8s overlay without a cluster: every pod's container command and
environment as the kubelet would start it (`$(VAR)` expanded, the downward API's pod IP and
namespace, Secrets as files), each as a process in a network namespace of its own with its own
address on a shared bridge (netns_cluster.py). The test process is the "node": it probes the pods'
readiness as the kubelet does, serves sglang-router's pod watch (fake_kube_api.py: the router keeps
its --service-discovery flags, the pods it is told of are the ones started here, Ready), and is the
client. Nothing else differs from the manifests, except what the caller overrides: extra server
flags (a small model) and environment (a build cache).

    with ManifestRun.start("2p2d", tmp, server_args=["--model-path", tiny]) as run:
        run.call(httpx.post, run.router_url + "/generate", json=..., headers=run.auth)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from kvpipe.launch.store_master import master_binary
from tests.helpers.fake_kube_api import FakeKubeAPI, pod_object
from tests.helpers.k8s_manifests import Pod, Secrets, pods, render
from tests.helpers.netns_cluster import NetnsCluster

T = TypeVar("T")
NAMESPACE = "kvpipe"  # the overlays' namespace
NODE = "node"  # the test's own host: kubelet probes, the API server, the client
SERVER_ROLES = ("prefill", "decode", "store-master")


def program(argv: list[str]) -> list[str]:
    """The image's programs on this machine: kvpipe and python are ours (this checkout, this venv),
    mooncake_master the Mooncake wheel's."""
    head, rest = argv[0], argv[1:]
    if head == "kvpipe":
        return [sys.executable, "-m", "kvpipe.cli", *rest]
    if head == "python":
        return [sys.executable, *rest]
    if head == "mooncake_master":
        return [master_binary(), *rest]
    raise ValueError(f"{head}: not a program of the image")


def probe_url(pod: Pod, ip: str, kind: str = "readinessProbe") -> str:
    """The URL a kubelet's httpGet probe of `pod` asks (a named or numbered port)."""
    get = pod.container[kind]["httpGet"]
    port = get["port"]
    return f"http://{ip}:{pod.port(port) if isinstance(port, str) else port}{get['path']}"


@dataclass
class ManifestRun:
    cluster: NetnsCluster
    pods: list[Pod]
    secrets: Secrets
    logs: Path
    procs: dict[str, Any] = field(default_factory=dict)  # pod name -> Popen
    api: FakeKubeAPI | None = None

    # ---- starting ----------------------------------------------------------------------------
    @classmethod
    def start(
        cls,
        overlay: str,
        tmp: Path,
        server_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        timeout_s: float = 300.0,
    ) -> ManifestRun:
        """Render `overlay`, start its servers, wait until each is ready, then the router."""
        all_pods = pods(render(overlay))
        cluster = NetnsCluster([*(p.name for p in all_pods), NODE])
        logs = tmp / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        run = cls(cluster, all_pods, Secrets.new(), logs)
        cluster.up()
        try:
            dirs = run.secrets.write(tmp / "secrets")
            servers = [p for p in all_pods if p.role in SERVER_ROLES]
            for p in servers:
                run._spawn(p, dirs, server_args if p.role in ("prefill", "decode") else None, env or {})
            run.wait_ready(servers, timeout_s)
            run._start_router(dirs, tmp, env or {}, timeout_s)
        except BaseException:
            run.close()
            raise
        return run

    def _spawn(self, pod: Pod, dirs: dict[str, Path], extra: list[str] | None, env: dict[str, str]) -> None:
        pod_env = pod.env(self.ip(pod), NAMESPACE)
        argv = program(pod.argv(pod_env, dirs)) + (extra or [])
        full_env = {**_inherited(), **pod_env, **env}
        self.procs[pod.name] = self.cluster.popen(pod.name, argv, full_env, self.logs / f"{pod.name}.log")

    def _start_router(self, dirs: dict[str, Path], tmp: Path, env: dict[str, str], timeout_s: float) -> None:
        listed = [
            pod_object(p.name, NAMESPACE, self.ip(p), p.labels, p.annotations)
            for p in self.pods
            if p.role in ("prefill", "decode")
        ]
        self.api = self.cluster.call(NODE, FakeKubeAPI, self.cluster.addr[NODE], NAMESPACE, listed).start()
        kubeconfig = self.api.kubeconfig(tmp / "kubeconfig")
        router = self.router
        self._spawn(router, dirs, None, {**env, "KUBECONFIG": str(kubeconfig)})
        self.wait_ready([router], timeout_s)

    # ---- waiting and asking -------------------------------------------------------------------
    def wait_ready(self, which: list[Pod], timeout_s: float) -> None:
        """Until every pod's readiness probe answers 2xx (as the kubelet sees it); fail early
        when one exited."""
        deadline = time.monotonic() + timeout_s
        pending = list(which)
        while pending:
            for p in list(pending):
                proc = self.procs[p.name]
                if proc.poll() is not None:
                    raise RuntimeError(f"{p.name} exited with {proc.returncode}:\n{self.log(p.name)[-3000:]}")
                if self.call(_answers, probe_url(p, self.ip(p))):
                    pending.remove(p)
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"not ready after {timeout_s:.0f} s: {[p.name for p in pending]}\n{self.tails()}")
            time.sleep(0.5)

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(...) from the node's namespace (the client, the kubelet, Prometheus)."""
        return self.cluster.call(NODE, fn, *args, **kwargs)

    def ip(self, pod: Pod) -> str:
        return self.cluster.addr[pod.name]

    @property
    def router(self) -> Pod:
        return next(p for p in self.pods if p.role == "router")

    @property
    def router_url(self) -> str:
        return f"http://{self.ip(self.router)}:{self.router.port('http')}"

    @property
    def auth(self) -> dict[str, str]:
        """What a client sends the router (its --api-key, the Secret's)."""
        return {"Authorization": f"Bearer {self.secrets.api_key}"}

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.secrets.admin_key}"}

    def of_role(self, role: str) -> list[Pod]:
        return [p for p in self.pods if p.role == role]

    def log(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def tails(self) -> str:
        return "\n".join(f"--- {p.name}\n{self.log(p.name)[-2000:]}" for p in self.pods)

    def close(self) -> None:
        """Stop the router first, then the servers (each drains), delete the namespaces."""
        router = self.procs.get(self.router.name) if self.procs else None
        try:
            if router is not None and router.poll() is None:
                router.terminate()
                router.wait(30)
        except Exception:  # noqa: BLE001 - the cluster's close kills what is left
            pass
        if self.api is not None:
            self.api.close()
        self.cluster.close()

    def __enter__(self) -> ManifestRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _inherited() -> dict[str, str]:
    """What a pod's process keeps of ours: PATH, PYTHONPATH (this checkout) and the locale."""
    import os

    keep = ("PATH", "PYTHONPATH", "LANG", "LC_ALL", "VIRTUAL_ENV")
    return {k: os.environ[k] for k in keep if k in os.environ}


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code < 300
    except httpx.HTTPError:
        return False
