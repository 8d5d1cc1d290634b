"""A rank that succeeded must not reach interpreter teardown with gloo threads alive: torch
keeps the gloo process group past destroy_process_group once torch._dynamo has imported
torch.distributed.nn after init_process_group (its functions take `group.WORLD` as a default
argument; transformers and DTensor's collectives import dynamo), and gloo threads alive
during teardown occasionally abort the process after it reported success (see tests/gloo.py)."""
from __future__ import annotations

import atexit
import os
from pathlib import Path

from gloo import spawn_cases


def _gloo_threads() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{task}/comm").read_text().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sorted(name for name in names if "gloo" in name)


def _report_gloo_threads_at_teardown(path: str) -> None:
    if threads := _gloo_threads():
        Path(path).write_text(" ".join(threads))


def _case_import_dynamo_then_register_teardown_check(case, rank, world):
    import torch._dynamo  # noqa: F401  (as transformers and DTensor's collectives do, after init_process_group)

    atexit.register(_report_gloo_threads_at_teardown, f"{case}/rank{rank}")


def test_no_rank_reaches_interpreter_teardown_with_gloo_threads(tmp_path):
    (tmp_path / "reports").mkdir()
    spawn_cases(2, [str(tmp_path / "reports")], tmp_path, _case_import_dynamo_then_register_teardown_check)
    reports = {p.name: p.read_text() for p in (tmp_path / "reports").iterdir()}
    assert not reports, f"ranks tore the interpreter down beside live gloo threads: {reports}"
