"""A real S3-compatible server on loopback for the object-storage tests: ``moto.server`` in
its own process (one per test session), a fresh bucket per test, the client configured the
usual way (environment variables), and a proxy in front of it that can fail requests (5xx
for a while, or drop every connection as if the server stopped)."""

from __future__ import annotations

import contextlib
import http.client
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

pytest.importorskip("obstore", reason="pip install 'pitstop[s3]'")
pytest.importorskip("moto", reason="pip install 'moto[server]'")
boto3 = pytest.importorskip("boto3")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_listening(port: int, proc: subprocess.Popen[bytes], secs: float = 30.0) -> None:
    deadline = time.monotonic() + secs
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto.server exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"moto.server did not listen on port {port} within {secs} s")


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        _wait_listening(port, proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


class _Proxy(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, upstream: str) -> None:
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.upstream = upstream.split("://", 1)[1]
        self.fail_status: int | None = None  # answer every request with this status
        self.fail_count = 0  # ... this many times (then forward again)
        self.dead = False  # drop every connection (the server is gone)
        self.die_after_puts: int | None = None  # ... from the N+1-th PUT on
        self.lock = threading.Lock()
        self.requests = 0
        self.failed = 0

    def decide(self, method: str) -> str:
        with self.lock:
            self.requests += 1
            if self.dead:
                return "drop"
            if self.die_after_puts is not None and method == "PUT":
                if self.die_after_puts == 0:
                    self.dead = True
                    return "drop"
                self.die_after_puts -= 1
            if self.fail_status is not None and self.fail_count > 0:
                self.fail_count -= 1
                self.failed += 1
                return "fail"
            return "forward"


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Proxy

    def log_message(self, *args: Any) -> None:
        return None

    def _any(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        what = self.server.decide(self.command)
        if what == "drop":
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        if what == "fail":
            status = self.server.fail_status or 503
            payload = (
                b'<?xml version="1.0"?><Error><Code>SlowDown</Code>'
                b"<Message>injected by the test proxy</Message></Error>"
            )
            self.send_response(status)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        conn = http.client.HTTPConnection(self.server.upstream, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
        conn.request(self.command, self.path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        conn.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any


@dataclass
class Bucket:
    """One test's bucket on the server; ``url(prefix)`` is what a user would pass."""

    name: str
    endpoint: str
    client: Any
    proxy: _Proxy | None = None
    _urls: list[str] = field(default_factory=list)

    def url(self, prefix: str = "run") -> str:
        return f"s3://{self.name}/{prefix}"

    def env(self) -> dict[str, str]:
        """The environment a subprocess needs to reach this bucket (the server directly)."""
        env = dict(os.environ)
        env.update(
            AWS_ENDPOINT_URL=self.endpoint, AWS_ACCESS_KEY_ID="testing",
            AWS_SECRET_ACCESS_KEY="testing", AWS_REGION="us-east-1", AWS_ALLOW_HTTP="true",
        )  # fmt: skip
        return env

    def list_keys(self, prefix: str = "") -> list[str]:
        out: list[str] = []
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.name, Prefix=prefix
        ):
            out += [o["Key"] for o in page.get("Contents", [])]
        return sorted(out)

    def get(self, key: str) -> bytes:
        return bytes(self.client.get_object(Bucket=self.name, Key=key)["Body"].read())

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.name, Key=key, Body=data)

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.name, Key=key)

    def open_uploads(self) -> list[str]:
        got = self.client.list_multipart_uploads(Bucket=self.name)
        return [u["Key"] for u in got.get("Uploads", [])]


def _client(endpoint: str) -> Any:
    return boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id="testing",
        aws_secret_access_key="testing", region_name="us-east-1",
    )  # fmt: skip


@pytest.fixture
def bucket(moto_server: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Bucket]:
    """A fresh bucket; the client finds the server and credentials in the environment."""
    name = f"pitstop-{uuid.uuid4().hex[:12]}"
    client = _client(moto_server)
    client.create_bucket(Bucket=name)
    for k, v in {
        "AWS_ENDPOINT_URL": moto_server, "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true",
    }.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    yield Bucket(name, moto_server, client)


@pytest.fixture
def flaky_bucket(bucket: Bucket, monkeypatch: pytest.MonkeyPatch) -> Iterator[Bucket]:
    """``bucket``, reached through a proxy the test can make fail (``bucket.proxy``)."""
    proxy = _Proxy(bucket.endpoint)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{proxy.server_address[1]}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    bucket.proxy = proxy
    try:
        yield bucket
    finally:
        proxy.shutdown()
        proxy.server_close()
