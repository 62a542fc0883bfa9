"""A hostile registry (an HTTP server on 127.0.0.1 in this process): what
it answers is read bounded, its JSON and its text cannot make a traceback
or reach the terminal raw. No sandbox: each pull fails before a layer."""

from __future__ import annotations

import gzip
import hashlib
import http.server
import json
import threading
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nsbox.errors import NsboxError
from nsbox.storage import registry
from nsbox.storage.reference import parse
from nsbox.storage.store import Store

pytestmark = pytest.mark.timeout(60)

Answer = Callable[[http.server.BaseHTTPRequestHandler], None]


def _send(req: http.server.BaseHTTPRequestHandler, status: int, body: bytes, **headers: str) -> None:
    req.send_response(status)
    for k, v in {"Content-Length": str(len(body)), **headers}.items():
        req.send_header(k.replace("_", "-"), v)
    req.end_headers()
    req.wfile.write(body)


def _endless(req: http.server.BaseHTTPRequestHandler, status: int, mib: int = 256) -> None:
    """A chunked body of `mib` MiB, ended early if the client hangs up."""
    req.send_response(status)
    req.send_header("Transfer-Encoding", "chunked")
    req.end_headers()
    chunk = b"A" * (1 << 20)
    try:
        for _ in range(mib):
            req.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        req.wfile.write(b"0\r\n\r\n")
    except OSError:
        pass


@pytest.fixture
def server() -> Iterator[tuple[str, list[Answer]]]:
    """(host:port, [answer]): set answer[0] to what every GET gets."""
    answer: list[Answer] = [lambda req: _send(req, 404, b"")]

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            answer[0](self)

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{httpd.server_address[1]}", answer
    httpd.shutdown()
    httpd.server_close()


async def _manifest(host: str, reference: str = "1") -> tuple[bytes, str]:
    async with registry.Registry(parse(f"{host}/x/y:1")) as reg:
        return await reg.manifest(reference)


async def _peak(coro: object) -> tuple[BaseException | None, int]:
    """The error the coroutine raises, and the most memory it held meanwhile."""
    tracemalloc.start()
    try:
        await coro  # type: ignore[misc]
        error = None
    except Exception as e:
        error = e
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return error, peak


def _gzip_bomb(mib: int) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    zeros = bytes(1 << 20)
    return b"".join([*(c.compress(zeros) for _ in range(mib)), c.flush()])


async def test_a_gzip_error_body_is_read_bounded(server: tuple[str, list[Answer]]) -> None:
    """256 KiB of gzip saying 256 MiB of zeros: httpx had decoded it whole."""
    host, answer = server
    bomb = _gzip_bomb(256)
    answer[0] = lambda req: _send(req, 404, bomb, Content_Encoding="gzip")
    error, peak = await _peak(_manifest(host))
    assert isinstance(error, NsboxError) and "not found" in str(error), error
    assert "\n" not in str(error) and "\0" not in str(error)
    assert peak < 32 << 20, peak


@pytest.mark.parametrize("status", [404, 500])
async def test_an_endless_error_body_is_read_bounded(server: tuple[str, list[Answer]], status: int) -> None:
    host, answer = server
    answer[0] = lambda req: _endless(req, status)
    error, peak = await _peak(_manifest(host))
    assert isinstance(error, NsboxError), error
    assert len(str(error)) < 400 and peak < 32 << 20, (len(str(error)), peak)


async def test_a_token_answer_is_read_bounded(server: tuple[str, list[Answer]]) -> None:
    host, answer = server

    def auth(req: http.server.BaseHTTPRequestHandler) -> None:
        if req.path.startswith("/token"):
            _endless(req, 200)
        else:
            _send(req, 401, b"", WWW_Authenticate=f'Bearer realm="http://{host}/token",service="x"')

    answer[0] = auth
    error, peak = await _peak(_manifest(host))
    assert isinstance(error, registry.AuthError) and "more than 1048576 bytes" in str(error), error
    assert peak < 32 << 20, peak


async def test_a_token_answer_that_is_not_json(server: tuple[str, list[Answer]]) -> None:
    host, answer = server

    def auth(req: http.server.BaseHTTPRequestHandler) -> None:
        if req.path.startswith("/token"):
            _send(req, 200, b"[" * 100_000)
        else:
            _send(req, 401, b"", WWW_Authenticate=f'Bearer realm="http://{host}/token"')

    answer[0] = auth
    with pytest.raises(registry.AuthError, match="token service's answer is not a JSON object"):
        await _manifest(host)


async def test_error_text_reaches_the_terminal_escaped(server: tuple[str, list[Answer]]) -> None:
    host, answer = server
    body = json.dumps({"errors": [{"code": "DENIED", "message": "\x1b]0;owned\x07\x1b[2K\rfake line\n"}]}).encode()
    answer[0] = lambda req: _send(req, 403, body)
    with pytest.raises(registry.AuthError) as info:
        await _manifest(host)
    text = str(info.value)
    assert "\x1b" not in text and "\r" not in text and "\n" not in text, text
    assert "DENIED: \\x1b]0;owned\\x07" in text, text


async def test_a_tag_that_starts_with_sha_is_a_tag(server: tuple[str, list[Answer]]) -> None:
    """`sha-1a2b3c4` (a git-sha tag, common in CI) had been checked as a digest."""
    host, answer = server
    answer[0] = lambda req: _send(req, 200, b"{}", Content_Type="application/vnd.oci.image.manifest.v1+json")
    assert await _manifest(host, "sha-1a2b3c4") == (b"{}", "application/vnd.oci.image.manifest.v1+json")
    with pytest.raises(NsboxError, match="invalid digest"):
        await _manifest(host, "sha256:abc")


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _image(config: bytes, layer_size: bool = True) -> dict[str, bytes]:
    """path suffix -> body of a one-layer image whose config is `config`."""
    layer = gzip.compress(b"\0" * 1024, mtime=0)
    ldesc = {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": _digest(layer),
             **({"size": len(layer)} if layer_size else {})}
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": _digest(config),
                           "size": len(config)},
                "layers": [ldesc]}
    return {"/manifests/1": json.dumps(manifest).encode(), f"/blobs/{_digest(config)}": config,
            f"/blobs/{_digest(layer)}": layer}


GOOD_CONFIG = json.dumps({"architecture": "amd64", "os": "linux",
                          "rootfs": {"type": "layers", "diff_ids": [_digest(b"\0" * 1024)]}}).encode()


@pytest.mark.parametrize("case, message", [
    ("deep manifest", "the manifest is not a JSON object"),
    ("deep config", "the config is not a JSON object"),
    ("config not JSON", "the config is not a JSON object"),
    ("layer without a size", "gives sha256:[0-9a-f]+ no size"),
])
async def test_hostile_json_is_one_line(server: tuple[str, list[Answer]], tmp_path: Path, case: str,
                                        message: str) -> None:
    """A RecursionError, a JSONDecodeError, a KeyError had been tracebacks."""
    host, answer = server
    config = {"deep config": b'{"config": {"Labels": {"a": ' + b"[" * 200_000 + b"]" * 200_000 + b"}}}",
              "config not JSON": b"this is not json"}.get(case, GOOD_CONFIG)
    files = _image(config, layer_size=case != "layer without a size")
    if case == "deep manifest":
        files["/manifests/1"] = b"[" * 200_000 + b"]" * 200_000

    def serve(req: http.server.BaseHTTPRequestHandler) -> None:
        body = next((b for suffix, b in files.items() if req.path.endswith(suffix)), None)
        _send(req, 200 if body is not None else 404, body or b"",
              Content_Type="application/vnd.oci.image.manifest.v1+json")

    answer[0] = serve
    with pytest.raises(NsboxError, match=message) as info:
        await registry.pull(Store(tmp_path / "store"), f"{host}/x/y:1", platform="linux/amd64")
    assert "\n" not in str(info.value)
