"""A Prometheus server on this machine scraping a cluster's ``/metrics`` pages: Debian's
``prometheus`` binary (``make install`` installs it as root), run with a generated config.

For checking and drawing the dashboard's queries against a live cluster
(``tests/test_dashboard.py``, ``bench/dashboard_snapshot.py``); a deployment's own Prometheus
scrapes through the ServiceMonitor instead (``deploy/base``).

Contract: ``LocalPrometheus`` is a context manager; on entry the server answers and has
scraped every target at least once (its scrape loops start a few seconds after it is ready,
so a rate over a later window sees what happened since); on exit it is stopped. ``query`` and
``query_range`` return Prometheus's ``result`` lists and raise ``PrometheusError`` for a query
it refuses (with its message).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

START_TIMEOUT_S = 30.0


class PrometheusError(RuntimeError):
    """Prometheus refused a query or did not start."""


def prometheus_binary() -> str | None:
    """The ``prometheus`` executable on PATH, or None."""
    return shutil.which("prometheus")


class LocalPrometheus:
    """See the module docstring. ``targets``: job name -> a ``/metrics`` URL."""

    def __init__(self, targets: Mapping[str, str], scrape_interval: str = "1s") -> None:
        binary = prometheus_binary()
        if binary is None:
            raise PrometheusError("no prometheus binary on PATH (Debian: apt install prometheus)")
        self._binary = binary
        self._targets = dict(targets)
        self._interval = scrape_interval
        self._dir = Path(tempfile.mkdtemp(prefix="splitserve-prometheus-"))
        self._process: subprocess.Popen[bytes] | None = None
        self.url = ""

    def __enter__(self) -> LocalPrometheus:
        scrape_configs = [
            {
                "job_name": job,
                "scrape_interval": self._interval,
                "scrape_timeout": self._interval,
                "metrics_path": urllib.parse.urlsplit(url).path,
                "static_configs": [{"targets": [urllib.parse.urlsplit(url).netloc]}],
            }
            for job, url in self._targets.items()
        ]
        config = self._dir / "prometheus.yml"
        config.write_text(json.dumps({"scrape_configs": scrape_configs}))  # JSON is YAML
        port = _free_port()
        log = (self._dir / "prometheus.log").open("wb")
        self._process = subprocess.Popen(
            [
                self._binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={self._dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        self.url = f"http://127.0.0.1:{port}"
        try:
            self._wait_until_scraped()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_until_scraped(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self._process is not None
            if self._process.poll() is not None:
                raise PrometheusError(f"prometheus exited: {self.log_tail()}")
            try:
                if len(self.query("up == 1")) >= len(self._targets):
                    return
            except (OSError, PrometheusError):
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise PrometheusError(f"prometheus scraped not every target: {self.log_tail()}")
            time.sleep(0.2)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        shutil.rmtree(self._dir, ignore_errors=True)

    def log_tail(self, chars: int = 3000) -> str:
        path = self._dir / "prometheus.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's series (``/api/v1/query``, at now)."""
        return self._get("query", {"query": expr})

    def query_range(
        self, expr: str, start: float, end: float, step_s: float
    ) -> list[dict[str, Any]]:
        """A range query's series (``/api/v1/query_range``; Unix times)."""
        return self._get("query_range", {"query": expr, "start": start, "end": end, "step": step_s})

    def _get(self, api: str, params: Mapping[str, object]) -> list[dict[str, Any]]:
        address = f"{self.url}/api/v1/{api}?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(address, timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as error:
            raise PrometheusError(f"{params.get('query')}: {error.read().decode()}") from None
        if body.get("status") != "success":
            raise PrometheusError(f"{params.get('query')}: {body}")
        return body["data"]["result"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
