"""A real S3-compatible server for the ``s3`` tests: moto's, in its own process.

The server is a separate process on a free loopback port so that a test can kill it
(``stop``, SIGKILL: a crash, not a shutdown) and bring it back on the same port
(``start``). moto keeps everything in memory: after a restart the server is empty and
buckets must be created again.

    with S3Server() as server:
        server.create_bucket("kvtier-test")
        store = S3Store("s3://kvtier-test", **server.store_kwargs())

Credentials are dummies given to the constructor; nothing is read from the developer's
AWS environment (see ``isolate_aws_environment`` for the test process itself).
"""

from __future__ import annotations

import base64
import hashlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import boto3
from botocore.awsrequest import AWSResponse
from botocore.config import Config
from botocore.exceptions import ClientError

# one loopback-port picker and one throwaway CA for every test server
from support.redis_server import TlsFiles, free_port

__all__ = [
    "ErrorAnswers",
    "ListingDenied",
    "RequireContentMD5",
    "S3Server",
    "free_port",
    "isolate_aws_environment",
]

# Variables through which boto3 would pick up the developer's account, profile or endpoint.
_AWS_ENVIRONMENT = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_CA_BUNDLE",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
)


def isolate_aws_environment(monkeypatch: Any) -> None:
    """Hide the developer's AWS variables and config files from boto3 in this test.

    ``monkeypatch`` is pytest's fixture; everything is restored after the test.
    """
    for name in _AWS_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


# moto's server over TLS (argv: port, certificate, key, and the CA that signs the client
# certificates it demands, or ""): what ``python -m moto.server -c cert -k key`` runs,
# with an SSL context that can also ask for client certificates.
_TLS_SERVER = """
import ssl, sys
from werkzeug.serving import run_simple
from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication, MotoRequestHandler, create_backend_app,
)
port, cert_file, key_file, client_ca = int(sys.argv[1]), *sys.argv[2:5]
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain(cert_file, key_file)
if client_ca:
    context.load_verify_locations(client_ca)
    context.verify_mode = ssl.CERT_REQUIRED
run_simple(
    "127.0.0.1", port, DomainDispatcherApplication(create_backend_app), threaded=True,
    ssl_context=context, request_handler=MotoRequestHandler,
)
"""


class S3Server:
    """moto's S3 server as a child process on ``127.0.0.1:port``.

    Args:
        port: the port to serve on (None: a free one, kept across restarts).
        access_key_id, secret_access_key, region: the dummy credentials and region that
            ``client`` and ``store_kwargs`` use (moto accepts any).
        min_part_size: smallest non-last multipart part moto accepts (S3: 5 MiB), so that
            multipart uploads can be tested with small parts.
        tls: serve HTTPS only, with this certificate (``make_tls_files``); None: HTTP.
        client_certs: with ``tls``, accept only clients that present a certificate the
            same CA signed (mutual TLS).
        ready_timeout_s: how long ``start`` waits for the server to answer.

    The server starts on construction; ``stop``/``close`` kill it, ``start`` restarts it.
    Use it as a context manager (or call ``close``) so the process never outlives a test.

    Raises:
        RuntimeError: the server exited or did not answer within ``ready_timeout_s``
            (the message holds the end of its log).
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        access_key_id: str = "kvtier-test",
        secret_access_key: str = "kvtier-test-secret",
        region: str = "us-east-1",
        min_part_size: int = 1024,
        tls: TlsFiles | None = None,
        client_certs: bool = False,
        ready_timeout_s: float = 20.0,
    ):
        self.port = port or free_port()
        self.access_key_id = access_key_id
        self.secret_access_key = secret_access_key
        self.region = region
        self.min_part_size = min_part_size
        self.tls = tls
        self.client_certs = client_certs
        self.ready_timeout_s = ready_timeout_s
        self._process: subprocess.Popen | None = None
        self._admin: Any = None
        # NOTE: a file, not a pipe nobody drains; append mode, so reading it back (which
        # moves the offset the child shares) never makes the child overwrite it.
        self._log = tempfile.TemporaryFile("a+b")  # noqa: SIM115 - closed by close()
        try:
            self.start()
        except BaseException:
            self.close()
            raise

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:<port>`` (``https://`` with TLS), the same across restarts."""
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Start the server on ``port`` (after ``stop``: empty) and wait until it answers."""
        if self.running:
            return
        environment = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        environment.update(
            S3_UPLOAD_PART_MIN_SIZE=str(self.min_part_size),
            # moto derives its in-memory buffer from the part minimum; keep it sane.
            MOTO_S3_DEFAULT_KEY_BUFFER_SIZE=str(16 * 2**20),
        )
        if self.tls is None:
            command = ["-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        else:
            client_ca = self.tls.ca_file if self.client_certs else ""
            command = ["-c", _TLS_SERVER, str(self.port), *self._tls_files(), client_ca]
            environment["MOTO_PORT"] = str(self.port)
        self._process = subprocess.Popen(
            [sys.executable, *command],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=environment,
        )
        self._wait_ready()

    def stop(self) -> None:
        """Kill the server (SIGKILL, like a crash) and reap it. Idempotent."""
        if self._process is None:
            return
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGKILL)
        self._process.wait()
        self._process = None

    def close(self) -> None:
        """``stop`` and release the log file. Idempotent."""
        self.stop()
        if self._admin is not None:
            self._admin.close()
            self._admin = None
        if not self._log.closed:
            self._log.close()

    def __enter__(self) -> S3Server:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def client(self, **config: Any) -> Any:
        """A boto3 S3 client for this server (``config``: extra ``botocore`` Config)."""
        return boto3.session.Session(
            aws_access_key_id=self.access_key_id,
            aws_secret_access_key=self.secret_access_key,
            region_name=self.region,
        ).client(
            "s3",
            endpoint_url=self.endpoint_url,
            config=Config(
                retries={"max_attempts": 1, "mode": "standard"},
                client_cert=self._tls_files() if self.client_certs else None,
                **config,
            ),
            verify=self.tls.ca_file if self.tls else None,
        )

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` (moto: succeeds again if it exists)."""
        if self._admin is None:  # one client for all: making one costs a few hundred ms
            self._admin = self.client()
        self._admin.create_bucket(Bucket=name)

    def store_kwargs(self) -> dict[str, Any]:
        """The ``S3Store`` keyword arguments that point it at this server."""
        return dict(
            endpoint_url=self.endpoint_url,
            region=self.region,
            access_key_id=self.access_key_id,
            secret_access_key=self.secret_access_key,
        )

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self._process is None or self._process.poll() is not None:
                raise RuntimeError(f"moto server exited on port {self.port}:\n{self._tail()}")
            try:
                # Any HTTP answer means the app is up (a bare TCP accept is not enough).
                with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as raw:
                    sock = self._tls_context().wrap_socket(raw) if self.tls else raw
                    sock.sendall(b"GET /moto-api/ HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
                    if sock.recv(16).startswith(b"HTTP/"):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(
            f"moto server did not answer on port {self.port} within "
            f"{self.ready_timeout_s} s:\n{self._tail()}"
        )

    def tls_kwargs(self) -> dict[str, Any]:
        """The ``S3Store`` keyword arguments of this server's TLS: its CA, and the client
        certificate it asks for (the same CA signed it)."""
        if self.tls is None:
            return {}
        cert_file, key_file = self._tls_files() if self.client_certs else (None, None)
        return dict(ca_file=self.tls.ca_file, cert_file=cert_file, key_file=key_file)

    def _tls_files(self) -> tuple[str, str]:
        assert self.tls is not None
        return self.tls.cert_file, self.tls.key_file

    def _tls_context(self) -> ssl.SSLContext:
        assert self.tls is not None
        context = ssl.create_default_context(cafile=self.tls.ca_file)
        context.check_hostname = False  # the certificate names 127.0.0.1 by IP
        if self.client_certs:
            context.load_cert_chain(*self._tls_files())
        return context

    def _tail(self, size: int = 4000) -> str:
        self._log.flush()
        self._log.seek(0, os.SEEK_END)
        self._log.seek(max(0, self._log.tell() - size))
        return self._log.read().decode(errors="replace")


class _Body:
    def __init__(self, data: bytes):
        self.data = data

    def stream(self, **_: Any):
        yield self.data


class ErrorAnswers:
    """A ``before-send`` hook of a store's client that answers requests with an S3 error
    (HTTP ``status``, error ``code``) in place of the server: every request, or the first
    ``times`` of them (then the server answers). ``attempts`` counts the requests it saw,
    ``urls`` lists those it answered.
    ``code=None`` answers the bare status with no body, as S3 answers a HEAD request.

        answers = ErrorAnswers(503, "SlowDown")
        answers.install(store, "PutObject")
    """

    def __init__(
        self, status: int, code: str | None, message: str = "injected", times: int = -1
    ) -> None:
        self.status = status
        self.body = (
            b""
            if code is None
            else f"<Error><Code>{code}</Code><Message>{message}</Message></Error>".encode()
        )
        self.times = times
        self.attempts = 0
        self.urls: list[str] = []  # of the requests it answered

    def __call__(self, request: Any, **_: Any) -> AWSResponse | None:
        self.attempts += 1
        if 0 <= self.times < self.attempts:
            return None
        self.urls.append(request.url)
        return AWSResponse(request.url, self.status, {}, _Body(self.body))

    def install(self, client: Any, *operations: str) -> None:
        """Answer ``operations`` (``PutObject``, ``GetObject``) of the boto3 ``client``."""
        for operation in operations:
            client.meta.events.register(f"before-send.s3.{operation}", self)

    def remove(self, client: Any, *operations: str) -> None:
        for operation in operations:
            client.meta.events.unregister(f"before-send.s3.{operation}", self)


def _error_answer(request: Any, status: int, code: str | None, message: str) -> AWSResponse:
    """An S3 error answer to ``request``: a bare status when ``code`` is None (a HEAD's)."""
    body = "" if code is None else f"<Error><Code>{code}</Code><Message>{message}</Message></Error>"
    return AWSResponse(request.url, status, {}, _Body(body.encode()))


class RequireContentMD5:
    """A ``before-send`` hook of a store's client that takes a DeleteObjects request the
    way MinIO, OVH or CubeFS did before they accepted botocore's CRC32: without a
    Content-MD5 header it is answered ``400 MissingContentMD5``, with a wrong one
    ``400 BadDigest``; with the right one it goes on to the server. ``seen`` counts the
    DeleteObjects requests.

        RequireContentMD5().install(store._client)
    """

    def __init__(self) -> None:
        self.seen = 0

    def __call__(self, request: Any, **_: Any) -> AWSResponse | None:
        self.seen += 1
        given = request.headers.get("Content-MD5")
        if given is None:
            return _error_answer(request, 400, "MissingContentMD5", "Missing required header")
        if isinstance(given, bytes):
            given = given.decode()
        digest = hashlib.md5(request.body, usedforsecurity=False).digest()
        if given != base64.b64encode(digest).decode():
            return _error_answer(request, 400, "BadDigest", "Content-MD5 does not match")
        return None

    def install(self, client: Any) -> None:
        client.meta.events.register("before-send.s3.DeleteObjects", self)


class ListingDenied:
    """A ``before-send`` hook of a store's client that answers as S3 answers a client
    whose policy grants ``s3:GetObject``, ``s3:PutObject`` and ``s3:DeleteObject`` but not
    ``s3:ListBucket``, or grants that on ``listable_prefix`` only (a policy's
    ``s3:prefix`` condition): HeadBucket a bare 403; a ListObjectsV2 outside the listable
    prefix 403 ``AccessDenied``; a HEAD of an absent object outside it a bare 403 and a
    GET of one 403 ``AccessDenied``. Everything the policy allows goes on to the server.
    ``denied`` counts the requests it answered.

        ListingDenied(server).install(store._client)
    """

    def __init__(self, server: S3Server, listable_prefix: str | None = None) -> None:
        self.listable_prefix = listable_prefix
        self.denied = 0
        self._client = server.client()

    def __call__(self, request: Any, event_name: str, **_: Any) -> AWSResponse | None:
        operation = event_name.rpartition(".")[2]
        url = urlsplit(request.url)  # path style: /bucket/key
        bucket, _, key = url.path.lstrip("/").partition("/")
        if operation == "ListObjectsV2":
            prefix = parse_qs(url.query).get("prefix", [""])[0]
            if not self._listable(prefix):
                return self._deny(request, "AccessDenied")
        elif operation == "HeadBucket":
            return self._deny(request, None)
        elif operation in ("HeadObject", "GetObject"):
            key = unquote(key)
            if not self._listable(key) and not self._exists(bucket, key):
                return self._deny(request, "AccessDenied" if operation == "GetObject" else None)
        return None

    def install(self, client: Any) -> None:
        client.meta.events.register("before-send.s3", self)

    def remove(self, client: Any) -> None:
        client.meta.events.unregister("before-send.s3", self)

    def _listable(self, key_or_prefix: str) -> bool:
        return self.listable_prefix is not None and key_or_prefix.startswith(self.listable_prefix)

    def _exists(self, bucket: str, key: str) -> bool:
        try:
            self._client.head_object(Bucket=bucket, Key=key)
        except ClientError as exc:
            if exc.response["Error"]["Code"] == "404":
                return False
            raise
        return True

    def _deny(self, request: Any, code: str | None) -> AWSResponse:
        self.denied += 1
        return _error_answer(request, 403, code, "Access Denied")
