"""Real servers for tests, started on loopback on free ports in a temporary directory and always killed
afterwards: redis-server, a three-master Redis Cluster, and moto's S3 server."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import http.client
import os
import random
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

LOOPBACK = "127.0.0.1"
NO_REDIS = "redis-server not installed; .ci/run installs it with apt-get"

# Every process we start, so that an interrupted run still kills them on the way out.
_LIVE: set[subprocess.Popen] = set()


@atexit.register
def _kill_leftovers() -> None:
    for proc in list(_LIVE):
        with contextlib.suppress(OSError):
            proc.kill()


def require(binary: str, reason: str) -> str:
    path = shutil.which(binary)
    if path is None:
        pytest.skip(reason)
    return path


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A free port below 30000 whose +10000 (a Redis Cluster bus port) is free too. Chosen from a range
    the kernel does not hand out as ephemeral ports, so a restart on the same port rarely collides."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(20000, 30000)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair found in 20000-39999")


def wait_until(
    check: Callable[[], bool], what: str, timeout: float = 20.0, process: _Process | None = None
) -> None:
    """Polls `check` with short sleeps until it is true; fails with the server's log after `timeout`, or
    at once if the server's process has exited."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    while not check():
        if process is not None and not process.alive():
            raise RuntimeError(f"{what} exited\n{process.log_tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready after {timeout}s\n{process.log_tail() if process else ''}")
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


class _Process:
    """One server process with its log file, which can be killed and spawned again."""

    def __init__(self, argv: list[str], workdir: Path, name: str, env: dict[str, str] | None = None) -> None:
        self.argv = argv
        self.workdir = workdir
        self.log = workdir / f"{name}.log"
        self.env = env
        self.proc: subprocess.Popen | None = None

    def spawn(self) -> None:
        if self.alive():
            raise RuntimeError(f"{self.argv[0]} is already running")
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv, cwd=self.workdir, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=self.env
            )
        _LIVE.add(self.proc)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.kill()
            proc.wait(timeout=10)
            _LIVE.discard(proc)


@dataclasses.dataclass(frozen=True)
class TlsFiles:
    ca: Path
    cert: Path
    key: Path


def make_tls_files(directory: Path) -> TlsFiles:
    """A throwaway CA and a server certificate for 127.0.0.1, made with the openssl command."""
    openssl = require("openssl", "openssl not installed")
    directory.mkdir(parents=True, exist_ok=True)
    files = TlsFiles(directory / "ca.crt", directory / "server.crt", directory / "server.key")
    ca_key = directory / "ca.key"
    run = functools.partial(subprocess.run, check=True, capture_output=True, timeout=60)
    run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=hicached test CA",
        ]
        + ["-keyout", str(ca_key), "-out", str(files.ca)]
    )
    csr = directory / "server.csr"
    run(
        [openssl, "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1"]
        + ["-keyout", str(files.key), "-out", str(csr)]
    )
    ext = directory / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    run(
        [openssl, "x509", "-req", "-in", str(csr), "-CA", str(files.ca), "-CAkey", str(ca_key)]
        + ["-CAcreateserial", "-days", "2", "-extfile", str(ext), "-out", str(files.cert)]
    )
    return files


class RedisServer:
    """A redis-server without persistence. stop() kills it; start() brings it back on the same port.
    With `tls`, it speaks TLS only (rediss://)."""

    def __init__(
        self, workdir: Path, port: int | None = None, extra: tuple[str, ...] = (), tls: TlsFiles | None = None
    ) -> None:
        self.port = port or free_port()
        self.tls = tls
        self.dir = workdir / f"redis-{self.port}"
        self.dir.mkdir(parents=True, exist_ok=True)
        binary = require("redis-server", NO_REDIS)
        argv = [binary, "--port", str(self.port), "--bind", LOOPBACK, "--save", "", "--appendonly", "no"]
        argv += ["--dir", str(self.dir), "--maxmemory", "512mb", "--maxmemory-policy", "allkeys-lru"]
        if tls is not None:
            argv += ["--port", "0", "--tls-port", str(self.port), "--tls-auth-clients", "no"]
            argv += ["--tls-cert-file", str(tls.cert), "--tls-key-file", str(tls.key)]
            argv += ["--tls-ca-cert-file", str(tls.ca)]
        self._process = _Process([*argv, *extra], self.dir, "redis")

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://{LOOPBACK}:{self.port}/0"

    def command(self, *args: str) -> bytes:
        """Sends one inline command and returns the raw reply (enough for PING and CLUSTER INFO)."""
        with socket.create_connection((LOOPBACK, self.port), timeout=1.0) as raw:
            s = raw
            if self.tls is not None:
                s = ssl.create_default_context(cafile=str(self.tls.ca)).wrap_socket(
                    raw, server_hostname=LOOPBACK
                )
            s.sendall(" ".join(args).encode() + b"\r\n")
            return s.recv(65536)

    def ping(self) -> bool:
        try:
            return self.command("PING").startswith((b"+PONG", b"-NOAUTH"))  # answering is ready
        except OSError:
            return False

    def start(self) -> None:
        self._process.spawn()
        wait_until(self.ping, f"redis-server :{self.port}", process=self._process)

    def alive(self) -> bool:
        return self._process.alive()

    def stop(self) -> None:
        self._process.kill()

    def restart(self) -> None:
        self.stop()
        self.start()


class RedisClusterServers:
    """Three cluster-enabled redis-servers joined as masters without replicas."""

    def __init__(self, workdir: Path) -> None:
        self.nodes: list[RedisServer] = []
        for _ in range(3):
            port = free_port()
            extra = ("--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf")
            self.nodes.append(RedisServer(workdir, port, extra + ("--cluster-node-timeout", "5000")))

    @property
    def url(self) -> str:
        return self.nodes[0].url.removesuffix("/0")

    def _state_ok(self) -> bool:
        try:
            return all(b"cluster_state:ok" in n.command("CLUSTER", "INFO") for n in self.nodes)
        except OSError:
            return False

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        cli = require("redis-cli", NO_REDIS)
        addrs = [f"{LOOPBACK}:{n.port}" for n in self.nodes]
        subprocess.run(
            [cli, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=30,
        )
        wait_until(self._state_ok, "redis cluster state ok")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def restart(self) -> None:
        """Brings every stopped node back on its port; each reloads its nodes file, so the cluster
        re-forms."""
        for node in self.nodes:
            if not node.alive():
                node.start()
        wait_until(self._state_ok, "redis cluster state ok after restart")


class MotoServer:
    """moto's S3 in server mode, as a separate process so it can be stopped and restarted like a real
    remote store. It keeps its state in memory: a restart empties it."""

    def __init__(self, workdir: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        binary = require("moto_server", "moto_server not installed; install moto[server]")
        workdir.mkdir(parents=True, exist_ok=True)
        self._process = _Process(
            [binary, "-H", LOOPBACK, "-p", str(self.port)], workdir, f"moto-{self.port}", env
        )

    @property
    def endpoint_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def _answers(self) -> bool:
        conn = http.client.HTTPConnection(LOOPBACK, self.port, timeout=1.0)
        try:
            conn.request("GET", "/moto-api/")
            conn.getresponse().read()
            return True
        except OSError:
            return False
        finally:
            conn.close()

    def start(self) -> None:
        self._process.spawn()
        wait_until(self._answers, "moto_server", process=self._process)

    def stop(self) -> None:
        self._process.kill()

    def restart(self) -> None:
        self.stop()
        self.start()

    def client(self):  # a boto3 S3 client with dummy credentials, for setting up and corrupting objects
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )

    def create_bucket(self, bucket: str) -> None:
        self.client().create_bucket(Bucket=bucket)


def aws_env(tmp: Path) -> dict[str, str]:
    """Dummy credentials and no shared AWS files: the standard chain finds these and nothing else."""
    return {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(tmp / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp / "no-aws-credentials"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }


def env_with(**extra: str) -> dict[str, str]:
    return {**os.environ, **extra}
