"""`musekern keys`: make and read the ed25519 keys entries are signed with (store/signing.py).

    musekern keys generate NAME --out FILE   a secret key file (mode 0600); prints the public key NAME:base64
    musekern keys public FILE                the public key of a secret key file

A producer (CI) passes the secret key file to `prepare`/`export` (--sign-key FILE or MUSEKERN_SIGN_KEY); each
consumer lists the public key in MUSEKERN_TRUSTED_KEYS (or --trusted-keys) and then takes entries from a remote
or a bundle only when they carry a signature by it.
"""
from __future__ import annotations

import errno
from pathlib import Path

import click

from .common import Failure, emit_json, json_option, log


@click.group("keys")
def keys_cmd():
    """Signing keys: make one (generate), print a secret key's public half (public)."""


@keys_cmd.command("generate")
@click.argument("name")
@click.option("-o", "--out", "out", required=True, type=click.Path(dir_okay=False),
              help="Secret key file to write (mode 0600; never over an existing file).")
@json_option
def generate_cmd(name, out, as_json):
    """Make a new ed25519 key NAME (e.g. ci.example.org-1): write the secret key to --out, print the public
    key `NAME:base64` (what consumers put in MUSEKERN_TRUSTED_KEYS)."""
    from ..store import signing

    key = signing.generate(name)
    try:
        signing.write_secret(key, Path(out))
    except OSError as e:
        if e.errno == errno.EEXIST:
            raise Failure(f"{out} exists; a key file is never overwritten: remove it first or pick another path") \
                from None
        raise Failure(f"cannot write {out}: {e.strerror or e}") from None
    if as_json:
        emit_json({"name": key.name, "public_key": key.public_text, "secret_key_file": str(out)})
        return
    click.echo(key.public_text)
    log(f"secret key written to {out} (mode 0600): keep it secret; sign with `musekern prepare --sign-key {out}` "
        "or MUSEKERN_SIGN_KEY; trust the line above with MUSEKERN_TRUSTED_KEYS")


@keys_cmd.command("public")
@click.argument("secret_key_file", type=click.Path(dir_okay=False))
@json_option
def public_cmd(secret_key_file, as_json):
    """Print the public key (NAME:base64) of a secret key file."""
    from ..store import signing

    key = signing.SecretKey.load(secret_key_file)
    if as_json:
        emit_json({"name": key.name, "public_key": key.public_text})
    else:
        click.echo(key.public_text)


def register(group: click.Group) -> None:
    group.add_command(keys_cmd)
