"""The credentials the remote tests plant (a Hub token, AWS keys, presigned signatures, a
proxy password) and `no_secret_shown`, an autouse fixture (import it into a test module)
that fails a test in which any of them shows: in the message of any LazyLoadError made
during it, in any record of the "lazyload" logger, or in anything printed to stdout or
stderr (what the test read through capsys too, the CLI's output among it). `shown(text)`
adds text the test got another way (a subprocess's output)."""
from __future__ import annotations

import logging

import pytest

SECRET = "hf_s3cr3t-token-value"  # a Hub token, an AWS secret key
KEY_ID = "AKIDEDGESTESTKEYID"
SESSION = "edges-session-token-value"
SIGNATURE = "Sig0123456789abcdefSIGNATURE"  # a presigned URL's
POLICY = "eyJTdGF0ZW1lbnQiOlt7IlJlc291cmNlIjoiKiJ9XX0"
PAIR_ID = "APKAEIBAERJR2EXAMPLE"
PROXY_PASSWORD = "pr0xy-pa55word-value"
PLANTED = (SECRET, KEY_ID, SESSION, SIGNATURE, POLICY, PAIR_ID, PROXY_PASSWORD)


class Shown:
    """Everything a test showed, to be scanned for the planted secrets."""

    def __init__(self):
        self.texts: list[str] = []

    def __call__(self, text: str) -> str:
        self.texts.append(str(text))
        return text

    def leaks(self) -> list[tuple[str, str]]:
        return [(secret, text[:300]) for text in self.texts for secret in PLANTED if secret in text]


@pytest.fixture(autouse=True)
def no_secret_shown(monkeypatch, caplog, capsys):
    from lazyload.errors import LazyLoadError

    shown = Shown()
    made = LazyLoadError.__init__

    def recording(self, *args):
        made(self, *args)
        shown(str(self))
        shown(repr(self))

    read = capsys.readouterr

    def reading():
        captured = read()
        shown(captured.out)
        shown(captured.err)
        return captured

    monkeypatch.setattr(LazyLoadError, "__init__", recording)
    monkeypatch.setattr(capsys, "readouterr", reading)
    caplog.set_level(logging.DEBUG, logger="lazyload")
    yield shown
    capsys.readouterr()
    shown("\n".join(r.getMessage() for r in caplog.records if r.name.startswith("lazyload")))  # not moto's or boto's
    assert not shown.leaks(), f"a planted secret was shown: {shown.leaks()}"
