"""Defects found reviewing the remote-read, planner and AutoTP changes, each with the test
that showed it."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

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
