"""Remote cache over plain HTTP, in the layout of Bazel's HTTP cache.

    GET/HEAD/PUT  <url>/ac/<key>       the entry's manifest.json (the "action cache" record)
    GET/HEAD/PUT  <url>/cas/<sha256>   blobs by content hash (the cubin)

Any server that stores PUT bodies and serves them back works: nginx with WebDAV PUT,
bazel-remote, a bucket behind a proxy. urllib only (no requests: the runtime install stays small).

Rules this module keeps:
- Downloads are verified before they enter the local cache: the manifest gets every check `Cache.load`
  applies (store/manifest.py: canonical bytes, digest, key, ABI), its key parts must be the ones asked for,
  and the blob must be the manifest's size and sha256 and carry the manifest's symbol and ABI
  (store/elf.py). A remote can never plant a bad entry; a bad one is rejected with a warning.
- Bounded: the manifest read is capped at 1 MiB and the blob at the size the manifest declares (a
  Content-Length above it is refused before any body is read); each request has one deadline for all of it
  (connect, headers, body: MUSEKERN_REMOTE_TIMEOUT, default 10 s), enforced by cutting the connection when
  it passes, so a server trickling a byte a second cannot hold a request; and all requests of one
  RemoteCache (one prepare) share a budget (MUSEKERN_REMOTE_DEADLINE, default 120 s), after which prepare
  goes on without the remote.
- Credentials: Basic auth from the URL (http://user:password@host/) or a bearer token from
  MUSEKERN_REMOTE_TOKEN (one or the other), sent as the Authorization header. They stay with the host they
  were given for: no redirect is ever followed (a 3xx is an error that says where it pointed), so the header
  goes nowhere but the origin (or its proxy). They are never shown: every URL in a message goes through
  env.mask_url, and every warning has the password and the token replaced by *** whatever put them there.
- A remote is read-only unless upload is asked for: `push` is only called under prepare's
  `--upload`, and `Cache.obtain` pushes only through a RemoteCache made with `upload=True`. A push
  verifies what the remote holds (it downloads and checks the blob and the manifest, never trusting a HEAD)
  and overwrites what is wrong, so a poisoned blob is repaired by the next good upload.
- A dead or misbehaving remote never raises into prepare: pull returns None, push returns
  False, a warning is logged once, and after a connection failure the remote is marked dead
  so the remaining variants do not each wait for a timeout.
- Push writes the blob before the manifest, so /ac never points at a missing blob.
- Authenticity (store/signing.py): with trusted keys, a pulled entry needs a signature by one of them that
  verifies (checked before its blob is downloaded); with a signing key, what is pushed carries its signature.
"""
from __future__ import annotations

import base64
import http.client
import logging
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

from .. import env
from .cache import Cache, CacheError, Entry, manifest_bytes
from .keys import KeyParts, is_key
from .manifest import MAX_JSON_ITEMS, MAX_MANIFEST_BYTES, check, cubin_problems, parse_json
from .signing import SecretKey, TrustedKeys, sign_manifest

ENV_REMOTE = env.REMOTE.name
ENV_REMOTE_TIMEOUT = env.REMOTE_TIMEOUT.name
ENV_REMOTE_TOKEN = env.REMOTE_TOKEN.name
_TOKEN_RE = re.compile(r"[\x21-\x7e]{1,8192}")  # what a header value carries safely: visible ASCII, no space or CR/LF
DEFAULT_TIMEOUT_S = float(env.REMOTE_TIMEOUT.default)
DEFAULT_DEADLINE_S = float(env.REMOTE_DEADLINE.default)
_CHUNK = 1 << 16

log = logging.getLogger("musekern.remote")
log.addHandler(logging.NullHandler())  # a library: no "last resort" stderr copy of what prepare reports


class RemoteError(Exception):
    """Raised only for a bad URL or setting (a usage error); transfer failures are warnings."""


class _Miss(Exception):
    """404: the remote does not have it (not a failure)."""


class _Rejected(Exception):
    """What the remote sent is not what was asked for (a warning; the remote stays in use)."""


class _Expired(Exception):
    """A request ran past its deadline, or the remote past its budget."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None  # urllib then raises HTTPError(3xx): reported, never followed


def _recorded(cls, socks: list):
    """A connection class whose sockets are appended to `socks` once connected (so a request's watchdog can
    cut them: urllib drops the connection's own reference once the response starts, the response reads on)."""
    class Recorded(cls):
        def connect(self):
            super().connect()
            socks.append(self.sock)
    return Recorded


class _Http(urllib.request.HTTPHandler):
    def __init__(self, socks: list):
        super().__init__()
        self._socks = socks

    def http_open(self, req):
        return self.do_open(_recorded(http.client.HTTPConnection, self._socks), req)


class _Https(urllib.request.HTTPSHandler):
    def __init__(self, socks: list):
        super().__init__()
        self._socks = socks

    def https_open(self, req):
        return self.do_open(_recorded(http.client.HTTPSConnection, self._socks), req, context=self._context)


class RemoteCache:
    """A Bazel-HTTP-cache-style remote. `pull` and `push` never raise on network trouble."""

    def __init__(self, url: str, timeout: float = DEFAULT_TIMEOUT_S, upload: bool = False,
                 deadline: float = DEFAULT_DEADLINE_S, token: str | None = None, trusted: TrustedKeys | None = None,
                 sign_key: SecretKey | None = None):
        shown = env.mask_url(url)
        try:
            parsed = urllib.parse.urlsplit(url)
            host, port = parsed.hostname, parsed.port
        except (ValueError, TypeError) as e:
            # urllib's reason may quote a piece of a password (a '/' in it ends the host early): not shown then
            why = "a password's / ? # @ : must be percent-encoded" if shown != url else str(e)
            raise RemoteError(f"remote cache URL {shown!r} is not a URL ({why}): give http(s)://host[:port][/path]") \
                from None
        if parsed.scheme not in ("http", "https") or not host:
            raise RemoteError(f"remote cache URL must be http(s)://host[:port][/path], got {shown!r}")
        self._auth, self._secrets = None, []
        if parsed.username is not None:  # http://user:pass@host/ -> Authorization header
            password = urllib.parse.unquote(parsed.password or "")
            cred = f"{urllib.parse.unquote(parsed.username)}:{password}"
            self._auth = "Basic " + base64.b64encode(cred.encode()).decode()
            self._secrets = [parsed.password or "", password, parsed.username if parsed.password is None else ""]
            netloc = (f"[{host}]" if ":" in host else host) + (f":{port}" if port else "")
            parsed = parsed._replace(netloc=netloc)
        token = (token or "").strip()
        if token:
            if self._auth:
                raise RemoteError(f"remote cache {shown}: credentials in the URL and {ENV_REMOTE_TOKEN} both set: "
                                  f"use one (unset {ENV_REMOTE_TOKEN}, or drop user:password@ from the URL)")
            if not _TOKEN_RE.fullmatch(token):
                raise RemoteError(f"{ENV_REMOTE_TOKEN} holds a space, a control or non-ASCII character, or is over "
                                  "8192 characters: set it to the token alone")
            self._auth = f"Bearer {token}"
            self._secrets = [token]
        if self._auth:
            self._secrets.append(self._auth.split(" ", 1)[1])  # a server echoing the header back
        self._secrets = [x for x in self._secrets if len(x) >= 4]  # shorter ones would mangle every message
        self.url = urllib.parse.urlunsplit(parsed._replace(query="", fragment="")).rstrip("/")
        try:
            self.timeout = env.parse_seconds(str(timeout))
            self.budget = env.parse_seconds(str(deadline))
        except ValueError as e:
            raise RemoteError(f"remote cache {self.url}: {e}") from None
        self.upload = bool(upload)
        self.trusted = trusted or TrustedKeys()  # keys a pulled entry must be signed by (none: not asked)
        self.sign_key = sign_key  # what push signs the manifests it uploads with
        self.dead = False  # set after a connection failure or a spent budget: later calls return at once
        self.warnings: list[str] = []
        self.stats = {"pulled": 0, "missed": 0, "rejected": 0, "pushed": 0, "push_skipped": 0, "errors": 0}
        self._started: float | None = None

    def __repr__(self) -> str:
        return f"RemoteCache({self.url!r}, upload={self.upload})"

    @classmethod
    def from_env(cls, cli_value: str | None = None, upload: bool = False, timeout: float | None = None,
                 trusted: TrustedKeys | None = None, sign_key: SecretKey | None = None) -> "RemoteCache | None":
        """--remote URL > $MUSEKERN_REMOTE > None (no remote). The bearer token comes from
        $MUSEKERN_REMOTE_TOKEN, the per-request timeout and the per-prepare budget from $MUSEKERN_REMOTE_TIMEOUT
        and $MUSEKERN_REMOTE_DEADLINE (musekern/env.py); a bad value raises RemoteError naming the variable."""
        url = cli_value or os.environ.get(ENV_REMOTE)
        if not url:
            return None
        try:
            timeout = env.seconds(env.REMOTE_TIMEOUT) if timeout is None else timeout
            deadline = env.seconds(env.REMOTE_DEADLINE)
        except env.EnvError as e:
            raise RemoteError(str(e)) from None
        return cls(url, timeout=timeout, upload=upload, deadline=deadline, token=os.environ.get(ENV_REMOTE_TOKEN),
                   trusted=trusted, sign_key=sign_key)

    # ------------------------------------------------------------ http
    def _warn(self, msg: str) -> None:
        msg = f"remote cache {self.url}: {msg}"
        for secret in self._secrets:  # whatever echoed one (a server's reason, an exception): never shown
            msg = msg.replace(secret, "***")
        self.warnings.append(msg)
        log.warning("%s", msg)

    def _deadline(self) -> tuple[float, str]:
        """When the next request must be done (its timeout, or the remote's budget if that ends sooner), and
        what to say when it is cut there."""
        now = time.monotonic()
        if self._started is None:
            self._started = now
        left = self._started + self.budget - now
        spent = f"spent its {self.budget:g} s budget for this run ({env.REMOTE_DEADLINE.name})"
        if left <= 0:
            raise _Expired(spent)
        if left < self.timeout:
            return now + left, spent
        return now + self.timeout, f"took longer than {self.timeout:g} s ({env.REMOTE_TIMEOUT.name})"

    def _request(self, method: str, path: str, data: bytes | None = None, limit: int = 0) -> tuple[int, bytes]:
        """(status, body of at most `limit` bytes). Raises _Miss on 404, _Rejected for a body over `limit`,
        _Expired past the deadline, OSError/HTTPError on trouble."""
        deadline, cut_reason = self._deadline()
        req = urllib.request.Request(f"{self.url}/{path}", data=data, method=method)
        if self._auth:
            req.add_header("Authorization", self._auth)
        if data is not None:
            req.add_header("Content-Type", "application/octet-stream")
        # The watchdog cuts the connection at the deadline: a socket timeout only bounds each read. Proxies
        # from the environment are used as urllib does; redirects never are.
        socks: list = []
        opener = urllib.request.build_opener(_NoRedirect(), _Http(socks), _Https(socks))
        expired = threading.Event()

        def cut():
            expired.set()
            for sock in list(socks):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        timer = threading.Timer(max(0.0, deadline - time.monotonic()), cut)
        timer.daemon = True
        timer.start()
        try:
            with opener.open(req, timeout=max(0.05, deadline - time.monotonic())) as resp:
                body = b""
                if method == "GET":
                    declared = resp.headers.get("Content-Length")
                    if declared is not None and declared.isdigit() and int(declared) > limit:
                        raise _Rejected(f"{path} is {declared} bytes, more than the {limit} expected")
                    chunks, got = [], 0
                    while got <= limit:
                        chunk = resp.read(min(_CHUNK, limit + 1 - got))
                        if not chunk:
                            break
                        chunks.append(chunk)
                        got += len(chunk)
                    if got > limit:
                        raise _Rejected(f"{path} sends more than the {limit} bytes expected")
                    body = b"".join(chunks)
                if expired.is_set():
                    raise _Expired(f"{method} {path} {cut_reason}")
                return resp.status, body
        except urllib.error.HTTPError as e:
            if e.code == 404:
                raise _Miss() from None
            raise
        except (OSError, http.client.HTTPException) as e:
            # the socket's own timeout (the same deadline) may fire before the watchdog thread does: the clock decides
            if expired.is_set() or time.monotonic() >= deadline:
                raise _Expired(f"{method} {path} {cut_reason}") from None
            if isinstance(e, http.client.HTTPException):
                raise OSError(f"bad HTTP answer ({type(e).__name__}: {e})") from None
            raise
        finally:
            timer.cancel()

    def _failed(self, what: str, exc: BaseException) -> None:
        self.stats["errors"] += 1
        if isinstance(exc, urllib.error.HTTPError) and 300 <= exc.code < 400:
            self.dead = True
            where = env.mask_url(exc.headers.get("Location", "?")) if exc.headers else "?"
            self._warn(f"{what}: answered {exc.code} redirect to {where}; musekern follows no redirects (credentials "
                       f"stay with the host you named): point --remote at the final URL. Continuing without it")
        elif isinstance(exc, urllib.error.HTTPError):
            self._warn(f"{what}: HTTP {exc.code} {exc.reason}")
        elif isinstance(exc, _Expired):
            self.dead = True
            self._warn(f"{what}: {exc}; continuing without the remote cache")
        elif isinstance(exc, (urllib.error.URLError, OSError)):
            # connection refused, DNS, timeout: the remote is unreachable; stop trying
            reason = getattr(exc, "reason", exc)
            self.dead = True
            self._warn(f"{what}: unreachable ({reason}); continuing without the remote cache")
        else:
            self._warn(f"{what}: {exc}")

    # ------------------------------------------------------------ pull
    def fetch(self, key: str, want: KeyParts | None = None) -> tuple[KeyParts, bytes, dict] | None:
        """Download and verify the entry `key` (and, given `want`, that it is that variant):
        (parts, cubin, manifest), or None on a miss, a rejected entry or remote trouble."""
        if self.dead:
            return None
        what = f"pull {key[:16]}"
        try:
            _, raw = self._request("GET", f"ac/{key}", limit=MAX_MANIFEST_BYTES)
            try:
                manifest = parse_json(raw, f"ac/{key[:16]}", max_items=MAX_JSON_ITEMS)
            except ValueError as e:
                raise _Rejected(str(e)) from None
            problems = check(manifest, key, raw)
            if problems:
                raise _Rejected(f"its manifest ac/{key[:16]} is not sound: {'; '.join(problems)}")
            parts = KeyParts.from_json(manifest["key_parts"])
            if want is not None and parts != want:
                raise _Rejected(f"its manifest describes {parts.label}, not the {want.label} asked for "
                                f"({', '.join(parts.differences(want))} differ)")
            refusal = self.trusted.refusal(manifest)
            if refusal:
                raise _Rejected(f"not trusted: {refusal}")
            sha, size = manifest["cubin_sha256"], manifest["cubin_size"]
            _, cubin = self._request("GET", f"cas/{sha}", limit=size)
            problems = cubin_problems(manifest, cubin)
            if problems:
                raise _Rejected(f"blob cas/{sha[:16]}: {'; '.join(problems)} (corrupt remote blob)")
        except _Miss:
            self.stats["missed"] += 1
            return None
        except _Rejected as e:
            self.stats["rejected"] += 1
            self._warn(f"{what}: rejected: {e}")
            return None
        except Exception as e:  # noqa: BLE001 - a remote must never crash prepare
            self._failed(what, e)
            return None
        return parts, cubin, manifest

    def pull(self, parts_or_key: KeyParts | str, cache: Cache) -> Entry | None:
        """Fetch `parts_or_key` into `cache`, verified; None on a miss, a bad entry or a dead remote. Given
        KeyParts, the entry must be exactly that variant."""
        want = parts_or_key if isinstance(parts_or_key, KeyParts) else None
        key = want.key() if want is not None else str(parts_or_key)
        if not is_key(key):
            raise ValueError(f"not a cache key: {key!r}")
        got = self.fetch(key, want)
        if got is None:
            return None
        parts, cubin, manifest = got
        try:
            entry = cache.put(parts, cubin, manifest)  # re-verifies every field
        except (CacheError, ValueError, TypeError) as e:
            self.stats["rejected"] += 1
            self._warn(f"pull {key[:16]}: not stored locally: {e}")
            return None
        self.stats["pulled"] += 1
        return entry

    # ------------------------------------------------------------ push
    def _holds(self, path: str, data: bytes) -> bool:
        """Whether the remote serves exactly `data` at `path` (downloaded and compared: a HEAD would trust a
        poisoned or truncated object)."""
        try:
            return self._request("GET", path, limit=len(data))[1] == data
        except (_Miss, _Rejected):
            return False

    def push(self, entry: Entry, cache: Cache | None = None) -> bool:
        """Upload a sound local entry (blob first, then manifest). True when the remote has it.

        What the remote already holds is downloaded and compared first; whatever differs (missing, poisoned,
        truncated, another entry's manifest) is overwritten. The caller decides to push (prepare does only
        under --upload); `upload=True` only makes `Cache.obtain(..., remote=...)` push what it builds. The
        entry is re-verified first so a damaged local entry is never spread. `cache` defaults to the cache
        the entry lives in.
        """
        if self.dead:
            return False
        cache = cache or Cache(entry.path.parents[2])  # <root>/v<format>/entries/<key>
        try:
            entry, cubin = cache.load(entry.key)
        except CacheError as e:
            self._warn(f"push {entry.key[:16]}: local entry not sound, not uploaded: {e}")
            return False
        sha = entry.manifest["cubin_sha256"]
        mbytes = manifest_bytes(sign_manifest(entry.manifest, self.sign_key))
        what = f"push {entry.key[:16]}"
        try:
            wrote = False
            if not self._holds(f"cas/{sha}", cubin):
                self._request("PUT", f"cas/{sha}", data=cubin)
                wrote = True
            if not self._holds(f"ac/{entry.key}", mbytes):
                self._request("PUT", f"ac/{entry.key}", data=mbytes)
                wrote = True
            if not wrote:
                self.stats["push_skipped"] += 1
        except Exception as e:  # noqa: BLE001 - a remote must never crash prepare
            self._failed(what, e)
            return False
        self.stats["pushed"] += 1
        return True

    def has(self, key: str) -> bool:
        """HEAD /ac/<key> (False on a miss or any trouble)."""
        if self.dead:
            return False
        try:
            self._request("HEAD", f"ac/{key}")
            return True
        except _Miss:
            return False
        except Exception as e:  # noqa: BLE001
            self._failed(f"head {key[:16]}", e)
            return False
