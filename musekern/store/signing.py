"""Signed entries: who vouches for an entry from a remote or a bundle (the anchor: Nix binary caches'
`trusted-public-keys` and their ed25519 signature per store path).

- A producer (CI) holds a secret key file made by `musekern keys generate NAME --out FILE` (mode 0600, one
  line `NAME:base64(seed + public key)`, Nix's format) and gives it to `prepare`/`export` as `--sign-key FILE`
  or MUSEKERN_SIGN_KEY. Each manifest it writes, exports or uploads gets `signatures: ["NAME:base64(sig)"]`.
- A consumer lists the public keys it trusts (`NAME:base64(public key)`, what `keys generate` prints) in
  MUSEKERN_TRUSTED_KEYS or `--trusted-keys` (whitespace-separated keys, or files holding them). Then an entry
  coming from a remote (prepare's pull) or a bundle (import) is refused, with one line saying why, unless one
  of its signatures is by a trusted key and verifies. Local builds are trusted; with no key listed nothing is
  asked of signatures (the integrity and ABI checks still apply).

What is signed: `signed_digest`, sha256 over the canonical JSON of every manifest field but `digest` and
`signatures` (so the key, the key parts, the variant, the symbol, the ABI and the cubin's sha256 and size),
prefixed by a domain tag. The manifest's `digest` covers the signatures too, so a flipped bit in a signature
is caught by the plain integrity check on every machine; a forger who edits a field and re-seals the digest
cannot re-sign it, so a consumer that trusts keys refuses it.

`cryptography` (the `sign` extra) is imported only to sign or to verify a signature by a trusted key: the
runtime never does either, so its import cost does not grow.
"""
from __future__ import annotations

import base64
import binascii
import importlib.util
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from .. import env
from .errors import CacheError
from .keys import canonical_json, sha256_hex

SIGNATURES = "signatures"
MAX_SIGNATURES = 8
MAX_TRUSTED_KEYS = 64
MAX_KEY_FILE_BYTES = 64 << 10
_DOMAIN = b"musekern-entry-signature-v1\0"
_NAME = r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}"
SIGNATURE_RE = re.compile(rf"^({_NAME}):([A-Za-z0-9+/]{{86}}==)$")  # 64 bytes of ed25519 signature
PUBLIC_RE = re.compile(rf"^({_NAME}):([A-Za-z0-9+/]{{43}}=)$")  # 32 bytes
SECRET_RE = re.compile(rf"^({_NAME}):([A-Za-z0-9+/]{{86}}==)$")  # 64 bytes: seed + public key (Nix)
NAME_RE = re.compile(rf"^{_NAME}$")
INSTALL_HINT = "pip install 'musekern[sign]' (adds cryptography)"


class SigningError(CacheError):
    """A key that cannot be read or used, or the sign extra missing: one line naming it and the fix."""


def _crypto():
    """cryptography's ed25519 module (imported here only: signing and verifying need it, nothing else)."""
    try:
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise SigningError(f"signatures need the cryptography package, which is not installed: {INSTALL_HINT}") \
            from None
    return ed25519


def require_crypto(what: str) -> None:
    """Raise SigningError (one line) now, not at the first entry, when `what` will need cryptography."""
    if importlib.util.find_spec("cryptography") is None:
        raise SigningError(f"{what} needs the cryptography package, which is not installed: {INSTALL_HINT}")


def _b64(text: str) -> bytes:
    return base64.b64decode(text.encode(), validate=True)


# ---------------------------------------------------------------- what is signed
def signed_digest(manifest: dict) -> str:
    """sha256 over the canonical JSON of every field but `digest` and `signatures`."""
    return sha256_hex(canonical_json({k: v for k, v in manifest.items() if k not in ("digest", SIGNATURES)}))


def _message(manifest: dict) -> bytes:
    return _DOMAIN + signed_digest(manifest).encode()


def signature_problems(value) -> list[str]:
    """What is wrong with a manifest's `signatures` field as data (its form, not whether it verifies)."""
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_SIGNATURES:
        return [f"manifest signatures must be a list of 1 to {MAX_SIGNATURES} signatures"]
    names = []
    for s in value:
        m = SIGNATURE_RE.match(s) if isinstance(s, str) else None
        if m is None:
            return [f"manifest signature {str(s)[:40]!r} is not NAME:base64 of 64 bytes"]
        names.append(m.group(1))
    if names != sorted(set(names)):
        return ["manifest signatures are not one per key name, sorted by name"]
    return []


def signers(manifest: dict) -> list[str]:
    """The key names an entry's manifest carries signatures of (unchecked)."""
    sigs = manifest.get(SIGNATURES)
    return [s.split(":", 1)[0] for s in sigs if isinstance(s, str)] if isinstance(sigs, list) else []


# ---------------------------------------------------------------- producer
@dataclass(frozen=True)
class SecretKey:
    name: str
    seed: bytes  # 32 bytes
    public: bytes  # 32 bytes

    def __repr__(self) -> str:  # never print the seed
        return f"SecretKey({self.name!r})"

    @property
    def public_text(self) -> str:
        return f"{self.name}:{base64.b64encode(self.public).decode()}"

    @classmethod
    def parse(cls, text: str, where: str) -> "SecretKey":
        m = SECRET_RE.match(text.strip())
        if m is None:
            raise SigningError(f"{where} is not a musekern secret key (NAME:base64 of 64 bytes, as `musekern keys "
                               "generate` writes)")
        raw = _b64(m.group(2))
        key = cls(m.group(1), raw[:32], raw[32:])
        if _crypto().Ed25519PrivateKey.from_private_bytes(key.seed).public_key().public_bytes_raw() != key.public:
            raise SigningError(f"{where}: its public half does not belong to its seed (damaged key file); make "
                               "a new one with `musekern keys generate`")
        return key

    @classmethod
    def load(cls, value: str) -> "SecretKey":
        """From --sign-key / MUSEKERN_SIGN_KEY: a key file's path (never the key itself: `musekern doctor` and
        CI logs show variables)."""
        if SECRET_RE.match(value.strip()):
            raise SigningError(f"{env.SIGN_KEY.name} / --sign-key take the path of the key file, not the key: write "
                               "it to a file (mode 0600) and name that")
        return cls.parse(_read_small(Path(value).expanduser(), "secret key file"), f"secret key file {value}")

    @classmethod
    def from_env(cls, cli_value: str | None = None) -> "SecretKey | None":
        """--sign-key > MUSEKERN_SIGN_KEY > None (no signing). SigningError (one line) for a key that cannot be
        read, or cryptography missing."""
        value = cli_value or os.environ.get(env.SIGN_KEY.name, "").strip()
        return cls.load(value) if value else None

    def sign(self, manifest: dict) -> list[str]:
        """`manifest`'s signatures with this key's (re)made, sorted by key name."""
        priv = _crypto().Ed25519PrivateKey.from_private_bytes(self.seed)
        sig = f"{self.name}:{base64.b64encode(priv.sign(_message(manifest))).decode()}"
        others = [s for s in manifest.get(SIGNATURES) or [] if isinstance(s, str) and not s.startswith(self.name + ":")]
        return sorted(others + [sig], key=lambda s: s.split(":", 1)[0])


def sign_manifest(manifest: dict, key: SecretKey | None) -> dict:
    """The sealed manifest with `key`'s signature added (the manifest itself when `key` is None)."""
    if key is None:
        return manifest
    from .manifest import seal

    return seal({**manifest, SIGNATURES: key.sign(manifest)})


def generate(name: str) -> SecretKey:
    if not NAME_RE.match(name or ""):
        raise SigningError(f"key name {str(name)[:70]!r}: use letters, digits and . _ + - (up to 64), e.g. "
                           "ci.example.org-1")
    priv = _crypto().Ed25519PrivateKey.generate()
    seed = priv.private_bytes_raw()
    return SecretKey(name, seed, priv.public_key().public_bytes_raw())


def write_secret(key: SecretKey, path: Path) -> None:
    """Write the key file, mode 0600, never over an existing file (a key lost is a key to rotate)."""
    text = f"{key.name}:{base64.b64encode(key.seed + key.public).decode()}\n".encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, text)
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_small(path: Path, what: str) -> str:
    """A key file's text: a regular file (a symlink to one is fine: mounted secrets are), at most 64 KiB, ASCII;
    never blocks on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise SigningError(f"{what} {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_KEY_FILE_BYTES:
            raise SigningError(f"{what} {path} is not a regular file of at most {MAX_KEY_FILE_BYTES} bytes")
        raw = os.read(fd, MAX_KEY_FILE_BYTES + 1)
    except OSError as e:
        raise SigningError(f"{what} {path}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    try:
        return raw[:MAX_KEY_FILE_BYTES].decode("ascii")
    except UnicodeDecodeError:
        raise SigningError(f"{what} {path} is not ASCII text") from None


# ---------------------------------------------------------------- consumer
@dataclass(frozen=True)
class TrustedKeys:
    """The public keys a consumer trusts, by name. Empty: signatures are not asked for."""
    keys: tuple[tuple[str, bytes], ...] = ()
    source: str = ""

    def __bool__(self) -> bool:
        return bool(self.keys)

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.keys]

    @classmethod
    def parse(cls, text: str, source: str) -> "TrustedKeys":
        """Whitespace-separated `NAME:base64` public keys, or paths of files holding such keys (one a line;
        `#` comments)."""
        found: dict[str, bytes] = {}
        for item in (text or "").split():
            if PUBLIC_RE.match(item):
                items = [(item, source)]
            elif SECRET_RE.match(item) or (":" in item and not os.path.exists(item)):
                raise SigningError(f"{source}: {item[:24]}... is not a public key (NAME:base64 of 32 bytes, what "
                                   "`musekern keys generate` prints)")
            else:
                body = _read_small(Path(item).expanduser(), f"{source}: trusted key file")
                lines = [ln.split("#", 1)[0].strip() for ln in body.splitlines()]
                items = [(ln, f"{source}: {item}") for ln in lines if ln]
            for key, where in items:
                m = PUBLIC_RE.match(key)
                if m is None:
                    raise SigningError(f"{where}: {key[:24]!r} is not a public key (NAME:base64 of 32 bytes)")
                name, raw = m.group(1), _b64(m.group(2))
                if found.get(name, raw) != raw:
                    raise SigningError(f"{where}: two different trusted keys are named {name}; give each its "
                                       "own name")
                found[name] = raw
                if len(found) > MAX_TRUSTED_KEYS:
                    raise SigningError(f"{source}: more than {MAX_TRUSTED_KEYS} trusted keys")
        return cls(tuple(sorted(found.items())), source)

    @classmethod
    def from_env(cls, cli_value: str | None = None) -> "TrustedKeys":
        """--trusted-keys > MUSEKERN_TRUSTED_KEYS > none. Raises SigningError when keys are given and cannot
        be read, or cryptography (the sign extra) is missing."""
        text, source = (cli_value, "--trusted-keys") if cli_value else (os.environ.get(env.TRUSTED_KEYS.name, ""),
                                                                        env.TRUSTED_KEYS.name)
        trusted = cls.parse(text, source)
        if trusted:
            require_crypto(f"{source} (checking signatures)")
        return trusted

    def refusal(self, manifest: dict) -> str | None:
        """Why an entry from a remote or a bundle must be refused under this trust (None: it may enter).
        The manifest has passed manifest.check (its signatures field, if any, is well formed)."""
        if not self.keys:
            return None
        trusted = dict(self.keys)
        names = signers(manifest)
        if not names:
            return f"unsigned: {self.source} asks for a signature by {', '.join(self.names)}"
        if not any(n in trusted for n in names):
            return (f"signed only by untrusted key{'s' if len(names) > 1 else ''} {', '.join(names)}; "
                    f"{self.source} trusts {', '.join(self.names)}")
        ed = _crypto()
        from cryptography.exceptions import InvalidSignature

        message = _message(manifest)
        bad = []
        for s in manifest[SIGNATURES]:
            name, sig = s.split(":", 1)
            if name not in trusted:
                continue
            try:
                ed.Ed25519PublicKey.from_public_bytes(trusted[name]).verify(_b64(sig), message)
                return None
            except (InvalidSignature, ValueError, binascii.Error):
                bad.append(name)
        return (f"the signature by {', '.join(bad)} does not match the manifest (changed after it was signed, or "
                "forged)")
