"""Just enough of a Kubernetes API server for sglang-router's service discovery: its pod watcher
(kube-rs) lists the pods of one namespace, then watches from that list's resourceVersion. The list
answers the pods given (what the kubelet would report: their IP, phase Running, Ready, the labels
and annotations of their manifests); the watch stays open without events until closed. The router
reaches it through a kubeconfig (`kubeconfig`) in place of its in-cluster service account.

Checked with sglang-router 0.3.2: with such a server its --prefill-selector / --decode-selector
pick the pods, it reads the bootstrap port from sglang.ai/bootstrap-port, and it sends its
--api-key to the workers it found.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

RESOURCE_VERSION = "1"


def pod_object(name: str, namespace: str, ip: str, labels: dict[str, str], annotations: dict[str, str]) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{name}",
            "resourceVersion": RESOURCE_VERSION,
            "labels": labels,
            "annotations": annotations,
        },
        "spec": {"containers": [{"name": "kvpipe", "image": "kvpipe:cpu"}]},
        "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
    }


class FakeKubeAPI:
    """Serves `pods` (pod objects) of `namespace` on (host, port); `start` from inside the
    namespace the server must listen in (its socket is made there)."""

    def __init__(self, host: str, namespace: str, pods: list[dict[str, Any]]) -> None:
        self.namespace = namespace
        self.requests: list[str] = []  # paths asked, for a test to check the router listed and watched
        self._stop = threading.Event()
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                api.requests.append(self.path)
                if self.path.split("?")[0] != f"/api/v1/namespaces/{api.namespace}/pods":
                    return self._json(404, {"kind": "Status", "status": "Failure", "code": 404})
                if "watch=true" in self.path or "watch=1" in self.path:
                    return self._hold()
                return self._json(
                    200,
                    {
                        "kind": "PodList",
                        "apiVersion": "v1",
                        "metadata": {"resourceVersion": RESOURCE_VERSION},
                        "items": pods,
                    },
                )

            def _json(self, code: int, obj: dict) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _hold(self) -> None:
                """A watch with no events: open (chunked) until the server closes."""
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self.wfile.flush()
                api._stop.wait(600)

        self._server = ThreadingHTTPServer((host, 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-kube-api", daemon=True)

    def start(self) -> FakeKubeAPI:
        self._thread.start()
        return self

    def kubeconfig(self, path: Path) -> Path:
        """A kubeconfig naming this server and namespace (a token that nobody checks)."""
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "netns", "cluster": {"server": self.url}}],
                    "contexts": [
                        {"name": "netns", "context": {"cluster": "netns", "namespace": self.namespace, "user": "u"}}
                    ],
                    "current-context": "netns",
                    "users": [{"name": "u", "user": {"token": "unused"}}],
                }
            )
        )
        return path

    def close(self) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()
