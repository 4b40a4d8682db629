"""Remote cache over plain HTTP, in the layout of Bazel's HTTP cache.

    GET/HEAD/PUT  <url>/ac/<key>       the entry's manifest.json (the "action cache" record)
    GET/HEAD/PUT  <url>/cas/<sha256>   blobs by content hash (the cubin)

Any server that stores PUT bodies and serves them back works: nginx with WebDAV PUT,
bazel-remote, a bucket behind a proxy. urllib only (no requests: the runtime install stays small).

Rules this module keeps:
- Downloads are verified (blob sha256 and size against the manifest, manifest against the key)
  before they enter the local cache, through `Cache.put`, so a remote can never plant a bad
  entry; a bad blob is rejected with a warning.
- A remote is read-only unless upload is asked for: `push` is only called under prepare's
  `--upload`, and `Cache.obtain` pushes only through a RemoteCache made with `upload=True`.
- A dead or misbehaving remote never raises into prepare: pull returns None, push returns
  False, a warning is logged once, and after a connection failure the remote is marked dead
  so the remaining variants do not each wait for a timeout.
- Push writes the blob before the manifest, so /ac never points at a missing blob.
"""
from __future__ import annotations

import base64
import json
import logging
import os
import urllib.error
import urllib.parse
import urllib.request

from .cache import CACHE_FORMAT, Cache, CacheError, Entry, manifest_bytes
from .keys import KeyParts, is_key, sha256_hex

ENV_REMOTE = "MUSEKERN_REMOTE"
ENV_REMOTE_TIMEOUT = "MUSEKERN_REMOTE_TIMEOUT"
DEFAULT_TIMEOUT_S = 10.0
MAX_MANIFEST_BYTES = 1 << 20
MAX_BLOB_BYTES = 256 << 20

log = logging.getLogger("musekern.remote")
log.addHandler(logging.NullHandler())  # a library: no "last resort" stderr copy of what prepare reports


class RemoteError(Exception):
    """Raised only for a bad URL (a usage error); transfer failures are warnings."""


class _Miss(Exception):
    """404: the remote does not have it (not a failure)."""


class RemoteCache:
    """A Bazel-HTTP-cache-style remote. `pull` and `push` never raise on network trouble."""

    def __init__(self, url: str, timeout: float = DEFAULT_TIMEOUT_S, upload: bool = False):
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise RemoteError(f"remote cache URL must be http(s)://host[:port][/path], got {url!r}")
        self._auth = None
        if parsed.username is not None:  # http://user:pass@host/ -> Authorization header
            cred = f"{urllib.parse.unquote(parsed.username)}:{urllib.parse.unquote(parsed.password or '')}"
            self._auth = "Basic " + base64.b64encode(cred.encode()).decode()
            netloc = parsed.hostname + (f":{parsed.port}" if parsed.port else "")
            parsed = parsed._replace(netloc=netloc)
        self.url = urllib.parse.urlunsplit(parsed._replace(query="", fragment="")).rstrip("/")
        self.timeout = float(timeout)
        self.upload = bool(upload)
        self.dead = False  # set after a connection failure: later calls return at once
        self.warnings: list[str] = []
        self.stats = {"pulled": 0, "missed": 0, "rejected": 0, "pushed": 0, "push_skipped": 0, "errors": 0}

    def __repr__(self) -> str:
        return f"RemoteCache({self.url!r}, upload={self.upload})"

    @classmethod
    def from_env(cls, cli_value: str | None = None, upload: bool = False,
                 timeout: float | None = None) -> "RemoteCache | None":
        """--remote URL > $MUSEKERN_REMOTE > None (no remote)."""
        url = cli_value or os.environ.get(ENV_REMOTE)
        if not url:
            return None
        if timeout is None:
            try:
                timeout = float(os.environ.get(ENV_REMOTE_TIMEOUT, DEFAULT_TIMEOUT_S))
            except ValueError:
                timeout = DEFAULT_TIMEOUT_S
        return cls(url, timeout=timeout, upload=upload)

    # ------------------------------------------------------------ http
    def _warn(self, msg: str) -> None:
        msg = f"remote cache {self.url}: {msg}"
        self.warnings.append(msg)
        log.warning("%s", msg)

    def _request(self, method: str, path: str, data: bytes | None = None, limit: int = MAX_BLOB_BYTES):
        """(status, body). Raises _Miss on 404, OSError/HTTPError on trouble."""
        req = urllib.request.Request(f"{self.url}/{path}", data=data, method=method)
        if self._auth:
            req.add_header("Authorization", self._auth)
        if data is not None:
            req.add_header("Content-Type", "application/octet-stream")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                body = resp.read(limit + 1) if method == "GET" else b""
                if len(body) > limit:
                    raise ValueError(f"{path}: response larger than {limit} bytes")
                return resp.status, body
        except urllib.error.HTTPError as e:
            if e.code == 404:
                raise _Miss() from None
            raise

    def _failed(self, what: str, exc: BaseException) -> None:
        self.stats["errors"] += 1
        if isinstance(exc, urllib.error.HTTPError):
            self._warn(f"{what}: HTTP {exc.code} {exc.reason}")
        elif isinstance(exc, (urllib.error.URLError, OSError)):
            # connection refused, DNS, timeout: the remote is unreachable; stop trying
            reason = getattr(exc, "reason", exc)
            self.dead = True
            self._warn(f"{what}: unreachable ({reason}); continuing without the remote cache")
        else:
            self._warn(f"{what}: {exc}")

    # ------------------------------------------------------------ pull
    def fetch(self, key: str) -> tuple[KeyParts, bytes, dict] | None:
        """Download and verify the entry `key`: (parts, cubin, manifest) or None (miss or bad)."""
        if self.dead:
            return None
        what = f"pull {key[:16]}"
        try:
            _, raw = self._request("GET", f"ac/{key}", limit=MAX_MANIFEST_BYTES)
            manifest = json.loads(raw)
            if not isinstance(manifest, dict):
                raise ValueError("manifest is not a JSON object")
            parts = KeyParts.from_json(manifest.get("key_parts"))
            if manifest.get("key") != key or parts.key() != key:
                raise ValueError("manifest belongs to another key")
            if manifest.get("format") != CACHE_FORMAT:
                raise ValueError(f"manifest format {manifest.get('format')!r} != {CACHE_FORMAT}")
            sha, size = manifest.get("cubin_sha256"), manifest.get("cubin_size")
            if not is_key(str(sha)) or not isinstance(size, int):
                raise ValueError("manifest lacks cubin_sha256/cubin_size")
            _, cubin = self._request("GET", f"cas/{sha}", limit=MAX_BLOB_BYTES)
        except _Miss:
            self.stats["missed"] += 1
            return None
        except (ValueError, TypeError, KeyError) as e:
            self.stats["rejected"] += 1
            self._warn(f"{what}: rejected a bad manifest ({e})")
            return None
        except Exception as e:  # noqa: BLE001 - a remote must never crash prepare
            self._failed(what, e)
            return None
        if len(cubin) != size or sha256_hex(cubin) != sha:
            self.stats["rejected"] += 1
            self._warn(f"{what}: rejected blob cas/{sha[:16]}: {len(cubin)} bytes hashing to "
                       f"{sha256_hex(cubin)[:16]}, manifest wants {size} bytes {sha[:16]} (corrupt remote blob)")
            return None
        return parts, cubin, manifest

    def pull(self, parts_or_key: KeyParts | str, cache: Cache) -> Entry | None:
        """Fetch `parts_or_key` into `cache`, verified; None on a miss, a bad blob or a dead remote."""
        key = parts_or_key.key() if isinstance(parts_or_key, KeyParts) else str(parts_or_key)
        if not is_key(key):
            raise ValueError(f"not a cache key: {key!r}")
        got = self.fetch(key)
        if got is None:
            return None
        parts, cubin, manifest = got
        if isinstance(parts_or_key, KeyParts) and parts != parts_or_key:
            self.stats["rejected"] += 1
            self._warn(f"pull {key[:16]}: rejected: key parts differ from the ones asked for")
            return None
        try:
            entry = cache.put(parts, cubin, manifest)  # re-verifies every added field
        except (CacheError, ValueError, TypeError) as e:
            self.stats["rejected"] += 1
            self._warn(f"pull {key[:16]}: not stored locally: {e}")
            return None
        self.stats["pulled"] += 1
        return entry

    # ------------------------------------------------------------ push
    def push(self, entry: Entry, cache: Cache | None = None) -> bool:
        """Upload a sound local entry (blob first, then manifest). True when the remote has it.

        The caller decides to push (prepare does only under --upload); `upload=True` only makes
        `Cache.obtain(..., remote=...)` push what it builds. The entry is re-verified first so a
        damaged local entry is never spread. `cache` defaults to the cache the entry lives in.
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
        what = f"push {entry.key[:16]}"
        try:
            try:
                self._request("HEAD", f"cas/{sha}")
                self.stats["push_skipped"] += 1
            except _Miss:
                self._request("PUT", f"cas/{sha}", data=cubin)
            self._request("PUT", f"ac/{entry.key}", data=manifest_bytes(entry.manifest))
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
