"""Defects found reviewing the remote-read, planner and AutoTP changes, each with the test
that showed it."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from test_remote import served  # noqa: F401

_HANGING_LOOKUP = textwrap.dedent("""
    import socket, threading
    from lazyload.errors import RemoteError
    from lazyload.remote import RemoteOptions
    from lazyload.remote.source import open_store
    from lazyload.remote.store import Stats

    real_lookup = socket.getaddrinfo

    def hanging_lookup(host, *args, **kwargs):  # a resolver that never answers for this name
        if host == "hung-lookup.test":
            threading.Event().wait()
        return real_lookup(host, *args, **kwargs)

    socket.getaddrinfo = hanging_lookup
    store, key = open_store("https://hung-lookup.test/ckpt/x.safetensors", RemoteOptions(retries=0, timeout=0.2))
    try:
        store.get(key, 0, 100, Stats())
    except RemoteError as exc:
        print("failed:", exc, flush=True)
""")


def test_a_hung_name_lookup_does_not_keep_the_process_from_exiting():
    """The attempt ends by its deadline while the lookup hangs; the process must then be able
    to exit (the lookup's thread must not be joined at interpreter exit)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    try:
        done = subprocess.run([sys.executable, "-c", _HANGING_LOOKUP], env=env, capture_output=True, text=True,
                              timeout=60)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the process did not exit after its load failed: {exc.stdout!r}")
    assert done.returncode == 0, done.stderr
    assert "looking up hung-lookup.test did not finish within the attempt's timeout" in done.stdout


@pytest.mark.parametrize("timeout", [None, 0, -1.0, float("nan"), float("inf"), "60"])
def test_a_remote_timeout_that_is_no_positive_number_of_seconds_is_an_argument_error(timeout, served):
    """An attempt's deadline is `timeout` seconds after it starts: None gave a TypeError from
    inside the read (not a LazyLoadError), 0 or less failed every attempt as a lookup timeout."""
    from lazyload import LazyCheckpoint
    from lazyload.errors import ArgumentError
    from lazyload.remote import RemoteOptions

    with pytest.raises(ArgumentError, match=r"^RemoteOptions\(timeout=.*\): seconds per attempt, a number > 0"):
        LazyCheckpoint(served[1], remote=RemoteOptions(timeout=timeout, retries=0))
