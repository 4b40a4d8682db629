"""musekern.remote against a real HTTP server: nginx with WebDAV PUT (Debian package `nginx`).

The `nginx_server` fixture starts nginx on 127.0.0.1 with a free port, a temp document root
and all of its pid/log/temp files in a temp dir, in the foreground (`daemon off`) as a
subprocess that teardown stops. Without the nginx binary these tests skip, saying why.
"""
from __future__ import annotations

import http.server
import logging
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
from conftest import free_port
from store_fakes import FAKE_ABI, real_builds

from musekern.store.cache import Cache
from musekern.store.keys import KeyParts
from musekern.store.remote import ENV_REMOTE, ENV_REMOTE_TOKEN, RemoteCache, RemoteError

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.usefixtures("no_proxy")  # CI may set http_proxy; the servers here are local
SRC = "ab" * 32


def fake_parts(i: int, dsl: str = "4.8.1") -> KeyParts:
    return KeyParts.make("qkv_front", {"n": 4352, "num_kv_heads": 1, "tiles": 1 + i % 2, "i": i}, "sm_90a", SRC,
                         dsl, 1)


def fake_build(parts: KeyParts, calls: list):
    def build():
        calls.append(parts.key())
        cubin = b"\x7fELF" + parts.key().encode() * 4
        return cubin, {"kernel": parts.kernel, "label": parts.label, "variant": parts.variant_params,
                       "symbol": "k", "arch": parts.arch, "abi": FAKE_ABI.to_json(), "built_with": {}}
    return build


def _fill(cache: Cache, n: int, calls: list) -> list[KeyParts]:
    parts = [fake_parts(i) for i in range(n)]
    for p in parts:
        cache.obtain(p, fake_build(p, calls))
    return parts


# ---------------------------------------------------------------- the scenarios
def test_warm_remote_means_zero_compiles(nginx_server, tmp_path):
    """Cache A builds and pushes; an empty cache B pulls everything and builds nothing."""
    url, root = nginx_server
    calls_a, calls_b = [], []
    a = Cache(tmp_path / "a")
    remote_a = RemoteCache(url, upload=True)
    parts = [fake_parts(i) for i in range(6)]
    for p in parts:
        _, source = a.obtain(p, fake_build(p, calls_a), remote=remote_a)  # miss remote, build, push
        assert source == "built"
    assert len(calls_a) == 6 and remote_a.stats["pushed"] == 6 and not remote_a.warnings
    assert sorted(os.listdir(root)) == ["ac", "cas"]
    assert sorted(os.listdir(root / "ac")) == sorted(p.key() for p in parts)

    b = Cache(tmp_path / "b")
    remote_b = RemoteCache(url)  # read-only: no upload asked for
    for p in parts:
        e, source = b.obtain(p, fake_build(p, calls_b), remote=remote_b)
        assert source == "remote"
        assert b.load(p.key())[1] == a.load(p.key())[1]
    assert calls_b == [] and remote_b.stats["pulled"] == 6 and not remote_b.warnings
    # the manifest B stored is byte-identical to A's (same canonical JSON)
    for p in parts:
        assert b.get(p.key()).manifest_path.read_bytes() == a.get(p.key()).manifest_path.read_bytes()


def test_pull_by_key_and_push_is_idempotent(nginx_server, tmp_path):
    url, _ = nginx_server
    a = Cache(tmp_path / "a")
    (p,) = _fill(a, 1, [])
    r = RemoteCache(url, upload=True)
    assert r.push(a.get(p.key())) and r.push(a.get(p.key()))
    assert r.stats["push_skipped"] == 1  # HEAD /cas found the blob: not uploaded twice
    assert r.has(p.key()) and not r.has("0" * 64)
    b = Cache(tmp_path / "b")
    assert r.pull(p.key(), b).key == p.key()
    assert r.pull("0" * 64, b) is None and r.stats["missed"] == 1 and not r.warnings


def test_corrupt_remote_blob_is_rejected(nginx_server, tmp_path, caplog):
    url, root = nginx_server
    a = Cache(tmp_path / "a")
    parts = _fill(a, 2, [])
    r = RemoteCache(url, upload=True)
    for p in parts:
        assert r.push(a.get(p.key()))
    # flip a byte of one blob, truncate the other's
    sha0 = a.get(parts[0].key()).manifest["cubin_sha256"]
    blob = bytearray((root / "cas" / sha0).read_bytes())
    blob[5] ^= 0xFF
    (root / "cas" / sha0).write_bytes(bytes(blob))
    sha1 = a.get(parts[1].key()).manifest["cubin_sha256"]
    (root / "cas" / sha1).write_bytes((root / "cas" / sha1).read_bytes()[:7])

    b = Cache(tmp_path / "b")
    rb = RemoteCache(url)
    with caplog.at_level(logging.WARNING, logger="musekern.remote"):
        for p in parts:
            assert rb.pull(p, b) is None
    assert rb.stats["rejected"] == 2 and b.entries() == [] and not rb.dead
    assert any("corrupt remote blob" in w for w in rb.warnings) and "corrupt remote blob" in caplog.text
    # prepare's path: the rejected entry is compiled locally instead
    calls = []
    for p in parts:
        e, source = b.obtain(p, fake_build(p, calls), remote=rb)
        assert source == "built" and b.verify_entry(e) == []
    assert len(calls) == 2


def test_foreign_manifest_is_rejected(nginx_server, tmp_path):
    """/ac/<key> holding another key's manifest must not plant a wrong entry."""
    url, root = nginx_server
    a = Cache(tmp_path / "a")
    p, q = _fill(a, 2, [])
    r = RemoteCache(url, upload=True)
    r.push(a.get(q.key()))
    (root / "ac").mkdir(exist_ok=True)
    shutil.copy(root / "ac" / q.key(), root / "ac" / p.key())
    b = Cache(tmp_path / "b")
    assert r.pull(p, b) is None and r.stats["rejected"] == 1 and b.get(p.key()) is None


def test_dead_remote_degrades_to_local_build(tmp_path, caplog):
    """Connection refused: a warning, then local builds; no exception reaches prepare."""
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    r = RemoteCache(url, timeout=2, upload=True)
    c = Cache(tmp_path / "c")
    calls = []
    parts = [fake_parts(i) for i in range(3)]
    with caplog.at_level(logging.WARNING, logger="musekern.remote"):
        for p in parts:
            e, source = c.obtain(p, fake_build(p, calls), remote=r)  # pull fails, build, push fails
            assert source == "built" and c.verify_entry(e) == []
    assert len(calls) == 3 and r.dead
    assert len(r.warnings) == 1 and "unreachable" in r.warnings[0]  # warned once, then skipped
    assert "unreachable" in caplog.text
    assert r.push(c.get(parts[0].key())) is False and r.pull(parts[0], c) is None


def test_hanging_remote_times_out(tmp_path):
    """A server that accepts but never answers: the timeout marks it dead instead of hanging prepare."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)  # never accept(): connects succeed, reads time out
    try:
        r = RemoteCache(f"http://127.0.0.1:{srv.getsockname()[1]}", timeout=0.5)
        t0 = time.monotonic()
        assert r.pull(fake_parts(0), Cache(tmp_path / "c")) is None
        assert r.dead and time.monotonic() - t0 < 5
    finally:
        srv.close()


def test_server_errors_warn_without_raising(tmp_path):
    """HTTP 500 on every request: pull gives None with a warning; push gives False."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def _fail(self):
            self.send_response(500)
            self.send_header("Content-Length", "0")
            self.end_headers()
        do_GET = do_HEAD = do_PUT = _fail

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        r = RemoteCache(f"http://127.0.0.1:{srv.server_address[1]}", timeout=5, upload=True)
        c = Cache(tmp_path / "c")
        (p,) = _fill(c, 1, [])
        assert r.pull(p, Cache(tmp_path / "d")) is None
        assert r.push(c.get(p.key())) is False
        assert any("HTTP 500" in w for w in r.warnings) and not r.dead
    finally:
        srv.shutdown()
        srv.server_close()


# ---------------------------------------------------------------- config
def test_from_env_and_url_validation(monkeypatch):
    monkeypatch.delenv(ENV_REMOTE, raising=False)
    assert RemoteCache.from_env(None) is None
    monkeypatch.setenv(ENV_REMOTE, "http://cache.example:8080/musekern/")
    r = RemoteCache.from_env(None)
    assert r.url == "http://cache.example:8080/musekern" and not r.upload
    assert RemoteCache.from_env("http://other:1", upload=True).url == "http://other:1"
    with pytest.raises(RemoteError):
        RemoteCache("ftp://x/")
    auth = RemoteCache("http://user:p%40ss@host:9/")
    assert auth.url == "http://host:9" and auth._auth.startswith("Basic ")


# ---------------------------------------------------------------- issue 12: the remote under a hostile server


class _Server:
    """A scripted HTTP server on 127.0.0.1 (`handler(request_handler)` answers each request); records every
    request's method, path and headers."""

    def __init__(self, handler):
        seen = self.seen = []

        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _any(self):
                seen.append((self.command, self.path, dict(self.headers)))
                n = int(self.headers.get("Content-Length") or 0)
                self.body = self.rfile.read(n) if n else b""
                handler(self)
            do_GET = do_HEAD = do_PUT = _any

            def log_message(self, *a):
                pass

        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.srv.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def close(self):
        self.srv.shutdown()
        self.srv.server_close()


@pytest.fixture
def server():
    made = []

    def make(handler):
        made.append(_Server(handler))
        return made[-1]
    yield make
    for s in made:
        s.close()


def test_a_trickling_server_is_cut_at_the_request_deadline(server, tmp_path):
    """1 byte every 0.2 s never trips a per-read timeout; the request's own deadline must end it
    (before: MUSEKERN_REMOTE_TIMEOUT=2 kept prepare waiting > 90 s)."""
    def trickle(h):
        h.send_response(200)
        h.send_header("Content-Length", "100000")
        h.end_headers()
        for _ in range(40):  # at most 8 s, then give up
            try:
                h.wfile.write(b"{")
                h.wfile.flush()
            except OSError:
                return
            time.sleep(0.2)

    s = server(trickle)
    r = RemoteCache(s.url, timeout=1)
    t0 = time.monotonic()
    assert r.pull(fake_parts(0), Cache(tmp_path / "c")) is None
    assert time.monotonic() - t0 < 3 and r.warnings


def test_credentials_never_follow_a_redirect_to_another_host(server, tmp_path):
    """A 302 from the remote to another host must not carry the URL's credentials there."""
    other = server(lambda h: (h.send_response(404), h.send_header("Content-Length", "0"), h.end_headers()))
    target = other.url.replace("127.0.0.1", "localhost")  # another host name for the same machine

    def redirect(h):
        h.send_response(302)
        h.send_header("Location", target + h.path)
        h.send_header("Content-Length", "0")
        h.end_headers()

    origin = server(redirect)
    r = RemoteCache(origin.url.replace("http://", "http://user:secret@"))
    assert r.pull(fake_parts(0), Cache(tmp_path / "c")) is None
    leaked = [headers for _, _, headers in other.seen if "Authorization" in headers]
    assert not leaked and r.warnings and "redirect" in r.warnings[0]


def _pushed_one(url: str, tmp_path):
    """(local cache, parts, uploading remote, blob sha) of one entry pushed to the remote at `url`."""
    a = Cache(tmp_path / "a")
    (p,) = _fill(a, 1, [])
    r = RemoteCache(url, upload=True)
    assert r.push(a.get(p.key()))
    return a, p, r, a.get(p.key()).manifest["cubin_sha256"]


def test_an_oversized_blob_is_refused_from_the_manifests_size(nginx_server, tmp_path):
    """cas/ holding far more bytes than the manifest declares: refused without reading them, and the warning
    names the blob (before: up to 256 MiB read, then a misleading 'bad manifest' warning)."""
    url, root = nginx_server
    a, p, r, sha = _pushed_one(url, tmp_path)
    with open(root / "cas" / sha, "wb") as f:
        f.truncate(300 << 20)  # sparse: 300 MiB of zeros on the server
    import tracemalloc

    rb = RemoteCache(url)
    tracemalloc.start()
    try:
        assert rb.pull(p, Cache(tmp_path / "b")) is None
        peak_mib = tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()
    assert peak_mib < 16, f"held {peak_mib:.0f} MiB to reject a blob"
    assert any(f"cas/{sha[:16]}" in w for w in rb.warnings) and not any("bad manifest" in w for w in rb.warnings)


def test_a_poisoned_blob_is_overwritten_by_a_good_upload(nginx_server, tmp_path):
    url, root = nginx_server
    a, p, r, sha = _pushed_one(url, tmp_path)
    (root / "cas" / sha).write_bytes(b"poison")
    assert r.push(a.get(p.key()))
    assert (root / "cas" / sha).read_bytes() == a.load(p.key())[1]
    assert RemoteCache(url).pull(p, Cache(tmp_path / "b")) is not None


@pytest.mark.parametrize("url", ["http://[::1", "http://host:99999/", "http://host:port/"])
def test_bad_urls_are_one_line_errors(url):
    with pytest.raises(RemoteError) as ei:
        RemoteCache(url)
    assert "\n" not in str(ei.value) and url in str(ei.value)


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "abc", "0"])
def test_bad_timeouts_are_one_line_errors_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(ENV_REMOTE, "http://cache.example:8080/")
    monkeypatch.setenv("MUSEKERN_REMOTE_TIMEOUT", value)
    with pytest.raises(RemoteError, match="MUSEKERN_REMOTE_TIMEOUT"):
        RemoteCache.from_env(None)


def test_one_prepare_spends_at_most_the_remote_budget(server, tmp_path):
    """Each request under its timeout, but slow: once the budget of the whole run (MUSEKERN_REMOTE_DEADLINE) is
    spent the remote is dropped with one warning naming the variable, and the rest builds locally at once."""
    def slow_miss(h):  # 8 of these take 4.8 s without a budget
        time.sleep(0.6)
        h.send_response(404)
        h.send_header("Content-Length", "0")
        h.end_headers()

    s = server(slow_miss)
    r = RemoteCache(s.url, timeout=2, deadline=1)
    c = Cache(tmp_path / "c")
    t0 = time.monotonic()
    for i in range(8):
        p = fake_parts(i)
        c.obtain(p, fake_build(p, []), remote=r)
    assert time.monotonic() - t0 < 3 and r.dead
    assert len(r.warnings) == 1 and "MUSEKERN_REMOTE_DEADLINE" in r.warnings[0]


def test_from_env_reads_the_budget(monkeypatch):
    monkeypatch.setenv(ENV_REMOTE, "http://cache.example/")
    monkeypatch.setenv("MUSEKERN_REMOTE_DEADLINE", "30")
    monkeypatch.setenv("MUSEKERN_REMOTE_TIMEOUT", "3")
    r = RemoteCache.from_env(None)
    assert (r.timeout, r.budget) == (3.0, 30.0)
    monkeypatch.setenv("MUSEKERN_REMOTE_DEADLINE", "-5")
    with pytest.raises(RemoteError, match="MUSEKERN_REMOTE_DEADLINE"):
        RemoteCache.from_env(None)


def test_an_ac_record_naming_another_variants_blob_is_rejected(nginx_server, tmp_path):
    """ac/<key> rewritten to name another variant's real blob, with its digest recomputed (a consistent
    forgery): the blob's ELF names another kernel, so the pull is rejected and nothing is stored."""
    from musekern.store import manifest as manifest_mod

    url, root = nginx_server
    (pa, ca, ma), (pb, cb, mb) = real_builds()
    a = Cache(tmp_path / "a")
    ea, eb = a.put(pa, ca, ma), a.put(pb, cb, mb)
    r = RemoteCache(url, upload=True)
    assert r.push(ea) and r.push(eb)
    forged = manifest_mod.seal({**ea.manifest, "cubin_sha256": eb.manifest["cubin_sha256"],
                                "cubin_size": eb.manifest["cubin_size"]})
    (root / "ac" / pa.key()).write_bytes(manifest_mod.manifest_bytes(forged))
    rb = RemoteCache(url)
    b = Cache(tmp_path / "b")
    assert rb.pull(pa, b) is None and b.get(pa.key()) is None
    assert rb.stats["rejected"] == 1 and "has no kernel" in rb.warnings[0]
    # and a good upload repairs the record
    assert r.push(ea) and RemoteCache(url).pull(pa, b) is not None


# ---------------------------------------------------------------- issue 28 finding 4: credentials, never shown
SECRET = "s3cret-pw"


def _answer(h, code: int, body: bytes = b"", reason: str | None = None):
    h.send_response(code, reason)
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    if h.command == "GET":
        h.wfile.write(body)


def _guarded_store(need: str, blobs: dict):
    """A Bazel-HTTP-style store in memory behind one Authorization value (401 without it, as nginx's
    auth_basic or a token-checking proxy answers)."""
    def handle(h):
        if h.headers.get("Authorization") != need:
            return _answer(h, 401, reason="Unauthorized")
        if h.command == "PUT":
            blobs[h.path] = h.body
            return _answer(h, 201)
        return _answer(h, 200, blobs[h.path]) if h.path in blobs else _answer(h, 404)
    return handle


# Both ways to authenticate: Basic from the URL, a bearer token from MUSEKERN_REMOTE_TOKEN. Each must reach the
# server on every request, and the secret must reach no message, warning, log record, repr or url.
@pytest.mark.parametrize("mode", ["basic", "token"])
def test_credentials_authenticate_every_request_and_are_never_shown(server, tmp_path, monkeypatch, caplog, mode):
    import base64

    caplog.set_level(logging.WARNING, "musekern.remote")
    blobs: dict = {}
    need = (f"Basic {base64.b64encode(f'ci:{SECRET}'.encode()).decode()}" if mode == "basic" else f"Bearer {SECRET}")
    s = server(_guarded_store(need, blobs))
    url = s.url.replace("http://", f"http://ci:{SECRET}@") if mode == "basic" else s.url
    if mode == "token":
        monkeypatch.setenv(ENV_REMOTE_TOKEN, SECRET)
    a = Cache(tmp_path / "a")
    (p,) = _fill(a, 1, [])
    up = RemoteCache.from_env(url, upload=True)
    assert up.push(a.get(p.key())) and len(blobs) == 2  # the blob and the manifest
    assert RemoteCache.from_env(url).pull(p, Cache(tmp_path / "b")) is not None
    assert s.seen and all(headers.get("Authorization") == need for _, _, headers in s.seen)
    # the server echoes the header in its reason phrase: the warning says 403, not the secret
    s.srv.RequestHandlerClass.do_GET = lambda h: _answer(h, 403, reason=f"no {h.headers.get('Authorization')}")
    r = RemoteCache.from_env(url)
    assert r.pull(p, Cache(tmp_path / "c")) is None and "HTTP 403 no " in r.warnings[0]
    shown = " ".join([*r.warnings, repr(r), r.url, up.url, caplog.text])
    assert SECRET not in shown and need.split()[1] not in shown


def test_a_missing_or_wrong_credential_is_a_warning_naming_the_status(server, tmp_path, monkeypatch):
    s = server(_guarded_store(f"Bearer {SECRET}", {}))
    monkeypatch.setenv(ENV_REMOTE_TOKEN, "wrong-token")
    r = RemoteCache.from_env(s.url)
    assert r.pull(fake_parts(0), Cache(tmp_path / "c")) is None
    assert "HTTP 401 Unauthorized" in r.warnings[0] and "wrong-token" not in r.warnings[0]


def test_a_redirects_location_is_shown_masked(server, tmp_path):
    def redirect(h):
        h.send_response(302)
        h.send_header("Location", f"http://u:{SECRET}@elsewhere/x")
        h.send_header("Content-Length", "0")
        h.end_headers()

    r = RemoteCache(server(redirect).url)
    assert r.pull(fake_parts(0), Cache(tmp_path / "c")) is None
    assert "redirect to http://u:***@elsewhere/x" in r.warnings[0] and SECRET not in r.warnings[0]


# Bad URLs that carry a password: urllib's own reason quotes a piece of it when an unencoded / or # ends the host
# early ("Port could not be cast to integer value as 's3'"); no scheme; another scheme; a bad IPv6 host.
@pytest.mark.parametrize("url", [f"http://ci:{SECRET}@[::1", "http://ci:s3/cret-pw@host/", "http://ci:s3#cret-pw@h/",
                                 f"ci:{SECRET}@host", f"ftp://ci:{SECRET}@host/", f"http://ci:{SECRET}@host:99999/"])
def test_bad_urls_never_show_the_password(url):
    with pytest.raises(RemoteError) as ei:
        RemoteCache(url)
    msg = str(ei.value)
    assert "\n" not in msg and "ci:***@" in msg and "cret" not in msg and "s3" not in msg


@pytest.mark.parametrize("token", ["two words", "line\nbreak", "t\u00f6ken", "x" * 8193])
def test_a_bad_token_is_refused_without_showing_it(token):
    with pytest.raises(RemoteError, match=ENV_REMOTE_TOKEN) as ei:
        RemoteCache("http://cache/", token=token)
    assert token[:6] not in str(ei.value)


def test_url_credentials_and_a_token_are_one_or_the_other(monkeypatch):
    monkeypatch.setenv(ENV_REMOTE_TOKEN, "tok-" + SECRET)
    with pytest.raises(RemoteError, match="both set") as ei:
        RemoteCache.from_env(f"http://ci:{SECRET}@cache/")
    assert SECRET not in str(ei.value)
    monkeypatch.setenv(ENV_REMOTE_TOKEN, "  ")  # blank is unset
    assert RemoteCache.from_env("http://cache/")._auth is None
