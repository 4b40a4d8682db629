"""musekern/env.py: every MUSEKERN_* variable read one way (flags, seconds, sizes); a bad value is one error
naming the variable, unset or empty is the default."""
from __future__ import annotations

import pytest

from musekern import env


@pytest.mark.parametrize("raw,want", [("1", True), ("true", True), ("YES", True), (" On ", True), ("0", False),
                                      ("False", False), ("OFF", False), ("No", False), (" 0", False), ("", False)])
def test_flags_are_read_one_way(monkeypatch, raw, want):
    """The review: MUSEKERN_AUTOBUILD was enabled by False, OFF, No and " 0"."""
    monkeypatch.setenv("MUSEKERN_AUTOBUILD", raw)
    assert env.flag(env.AUTOBUILD) is want


@pytest.mark.parametrize("raw", ["2", "enable", "tru", "-1"])
def test_a_bad_flag_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv("MUSEKERN_AUTOBUILD", raw)
    with pytest.raises(env.EnvError, match="MUSEKERN_AUTOBUILD"):
        env.flag(env.AUTOBUILD)


@pytest.mark.parametrize("raw", ["-1", "nan", "inf", "abc", "0", "1e999", "999999999"])
def test_bad_seconds_name_the_variable(monkeypatch, raw):
    monkeypatch.setenv("MUSEKERN_REMOTE_TIMEOUT", raw)
    with pytest.raises(env.EnvError, match="MUSEKERN_REMOTE_TIMEOUT"):
        env.seconds(env.REMOTE_TIMEOUT)


def test_seconds_and_their_default(monkeypatch):
    monkeypatch.delenv("MUSEKERN_REMOTE_TIMEOUT", raising=False)
    assert env.seconds(env.REMOTE_TIMEOUT) == 10.0
    monkeypatch.setenv("MUSEKERN_REMOTE_TIMEOUT", " 2.5 ")
    assert env.seconds(env.REMOTE_TIMEOUT) == 2.5


@pytest.mark.parametrize("text,want", [("500M", 500 * 10**6), ("1GiB", 2**30), ("1.5g", 1_500_000_000),
                                       ("1048576", 1048576), (" 2 kb ", 2000), ("0.1k", 100)])
def test_sizes_are_exact(text, want):
    assert env.parse_size(text) == want


@pytest.mark.parametrize("text", ["", "10x", "abc", "-1", "1e9", "9" * 400, "9" * 20 + "T", "1.5.5G"])
def test_bad_sizes_are_value_errors_never_overflow(text):
    """A 400-digit size was an OverflowError traceback (float('9'*400) is inf)."""
    with pytest.raises(ValueError):
        env.parse_size(text)


def test_every_variable_is_in_the_table():
    names = [v.name for v in env.VARIABLES]
    assert len(set(names)) == len(names) and all(n.startswith("MUSEKERN_") for n in names)
    assert {"MUSEKERN_MAX_SIZE", "MUSEKERN_REMOTE_DEADLINE", "MUSEKERN_REMOTE_TIMEOUT"} <= set(names)


# ---------------------------------------------------------------- issue 28 finding 4: credentials never shown
# The grid: Basic auth, a token as the user name (pip's rule: masked whole), an unencoded / # @ in the password
# (urllib parses the host wrong there; the mask must still end at the last @), no scheme, a query token, none.
@pytest.mark.parametrize("url,shown", [
    ("http://user:s3cret@cache:8080/mk", "http://user:***@cache:8080/mk"),
    ("https://s3cret@cache/", "https://***@cache/"),
    ("http://user:s3/cret@cache/", "http://user:***@cache/"),
    ("http://user:s3#cret@cache/", "http://user:***@cache/"),
    ("http://user:s3@cret@cache/", "http://user:***@cache/"),
    ("user:s3cret@cache", "user:***@cache"),
    ("http://cache/mk?token=s3cret&x#f", "http://cache/mk?token=***&***#f"),
    ("http://cache:8080/mk", "http://cache:8080/mk"),
    ("", ""),
])
def test_mask_url(url, shown):
    assert env.mask_url(url) == shown


def test_shown_masks_the_remote_and_hides_the_token(monkeypatch):
    monkeypatch.setenv("MUSEKERN_REMOTE", "http://user:s3cret@cache/")
    monkeypatch.setenv("MUSEKERN_REMOTE_TOKEN", "s3cret-token")
    assert env.shown(env.REMOTE) == ("http://user:***@cache/", "env")
    assert env.shown(env.REMOTE_TOKEN) == ("(set, not shown)", "env")
    monkeypatch.delenv("MUSEKERN_REMOTE_TOKEN")
    assert env.shown(env.REMOTE_TOKEN) == ("", "default")
