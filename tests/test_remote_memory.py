"""A remote load (HTTP, S3) holds no more host memory than a local one: at most the byte
budget (`max_host_bytes`) above its destination tensors. A GET's body is written into its
place (the staging arena, or the destination) as it arrives; a GET whose runs have gaps
between them passes through a scratch of `CHUNK` bytes, never a buffer of the whole GET.

The load runs in a fresh process (its peak belongs to that load alone), the server
(the HTTP Range server, moto's S3) in this one, so that the server's buffers are not counted.
"""
from __future__ import annotations

import numpy as np
import torch

from no_secrets import no_secret_shown  # noqa: F401 (an autouse fixture: no planted secret shows)
from remote_servers import RangeServer
from test_remote import s3, upload  # noqa: F401 (s3: a fixture)
from test_streaming import MiB, in_fresh_process, model_bytes, status

# 94 MiB of bf16, three 5.5 MiB MLP matrices per layer, each one GET: when each GET's body was
# held whole before it was copied, the engine's eight workers held up to eight of them beside
# the destination (43 MiB above it measured, over the 24 MiB allowed).
SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
             num_key_value_heads=4, vocab_size=2048, max_position_embeddings=128)
BUDGET = 8 * MiB  # max_host_bytes: above every single tensor (5.5 MiB), below one layer
SLACK = 16 * MiB  # what the process touches besides the load (thread stacks, an allocator arena)


def measured_remote_load(url: str, config, dtype: torch.dtype, cache_dir: str | None = None) -> dict:
    """In a fresh process: warm up on one layer, reset VmHWM, load from `url`, report (with
    the sha256 of each loaded tensor's bytes). With `cache_dir`, the warm-up uses a cache of
    its own beside it, so that a first load into `cache_dir` finds it empty."""
    import copy
    import gc
    import hashlib

    from checkpoints import build_model

    from lazyload import LazyCheckpoint
    from lazyload.remote import RemoteOptions

    def options(directory):
        return RemoteOptions(cache_dir=directory) if directory else None

    small = copy.deepcopy(config)
    small.num_hidden_layers = 1
    warm = build_model("llama", small, dtype, empty="meta")
    LazyCheckpoint(url, remote=options(cache_dir and cache_dir + "-warm-up")).load_into(
        warm, dtype=dtype, strict=False, progress=False, max_host_bytes=BUDGET)
    del warm
    model = build_model("llama", config, dtype, empty="meta")
    ckpt = LazyCheckpoint(url, remote=options(cache_dir))
    ckpt.index  # headers read before the baseline
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = status()
    report = ckpt.load_into(model, dtype=dtype, progress=False, max_host_bytes=BUDGET)
    digests = {k: hashlib.sha256(v.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()
               for k, v in model.state_dict().items()}
    return dict(before=before, after=status(), peak_anon=report.peak_anon, reader=report.reader,
                requests=report.requests, bytes_cached=report.bytes_cached, dest=model_bytes(model),
                digests=digests)


def test_http_load_peak_anonymous_memory_is_destination_plus_budget(checkpoint):
    """bf16 into bf16: the bytes land in the destination itself, and no response buffer
    holds them on the way (a cast load stages them in the arena, which is the budget)."""
    directory, config = checkpoint("llama", "bf16", **SHAPE)
    with RangeServer(str(directory)) as server:
        _assert_within_budget(in_fresh_process(measured_remote_load, server.url + "/", config, torch.bfloat16))


def test_s3_load_peak_anonymous_memory_is_destination_plus_budget(s3, checkpoint):
    """The same through obstore: its answers are streamed into place, not held whole."""
    client, bucket = s3
    directory, config = checkpoint("llama", "bf16", **SHAPE)
    upload(client, bucket, directory, "memory")
    _assert_within_budget(in_fresh_process(measured_remote_load, f"s3://{bucket}/memory/", config, torch.bfloat16))


def _assert_within_budget(r: dict) -> None:
    assert r["requests"] > 4 * 8  # every tensor a GET of its own, or more
    assert_peak_within_budget(r)


def assert_peak_within_budget(r: dict) -> None:
    assert r["reader"] == "remote"
    assert r["dest"] > 8 * BUDGET  # the load dwarfs the budget
    over = r["peak_anon"] - r["before"]["RssAnon"] - r["dest"]
    assert over < BUDGET + SLACK, (
        f"peak anonymous memory exceeds the destination ({r['dest'] / MiB:.1f} MiB) by {over / MiB:.1f} MiB; "
        f"max_host_bytes {BUDGET / MiB:.0f} MiB + {SLACK / MiB:.0f} MiB allowed")


def test_gets_land_in_place_or_through_a_bounded_scratch():
    """Every GET's bytes, written view by view as `landing` hands the views out, put each
    run in its place; a GET without gaps is one view of `out`, any other view is at most
    `chunk` bytes."""
    from lazyload.readers.remote import landing, plan_gets

    rng = np.random.default_rng(0)
    for _ in range(300):
        run = int(rng.integers(1, 40))
        gaps = rng.integers(0, 60, size=int(rng.integers(1, 30))) * (rng.random() < 0.8)  # some without gaps
        offsets = np.cumsum(np.concatenate([[int(rng.integers(0, 50))], gaps[1:] + run])).astype(np.int64)
        merge_gap, part, chunk = int(rng.integers(0, 50)), int(rng.integers(1, 200)), int(rng.integers(1, 64))
        file = rng.integers(0, 256, size=int(offsets[-1]) + run, dtype=np.uint8)
        out = np.zeros(len(offsets) * run, dtype=np.uint8)
        for get in plan_gets(offsets, run, merge_gap, part):
            views = list(_filled(landing(get, offsets, run, out, chunk), file, get))
            assert sum(views) == get.end - get.start
            adjacent = np.all(np.diff(offsets[get.first:get.last]) == run)
            assert len(views) == 1 if adjacent else max(views) <= chunk
        expected = np.concatenate([file[o:o + run] for o in offsets.tolist()])
        assert np.array_equal(out, expected)


def _filled(views, file: np.ndarray, get):
    """Write the GET's bytes into each view as a store reading a body would; their lengths."""
    at = get.start
    for view in views:
        np.frombuffer(view, dtype=np.uint8)[:] = file[at:at + len(view)]
        at += len(view)
        yield len(view)
