"""Hugging Face repo ids as checkpoint paths: a path that is not on disk but reads like
`org/name` is the snapshot huggingface_hub keeps in its local cache (what transformers'
`from_pretrained` loads offline). Nothing is ever downloaded."""
from __future__ import annotations

import os
import re
from typing import Any

from .errors import CheckpointError

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_HUB_NAME = re.compile(r"\w(?:[\w.-]{0,94}\w)?", re.ASCII)  # huggingface_hub's REPO_ID_REGEX, per part


def repo_id_problem(repo_id: str) -> str | None:
    """Why `org/name` is not a repo id the Hub accepts (huggingface_hub's `validate_repo_id`
    rules: ASCII letters, digits, `_ . -`, neither first nor last, at most 96 each, no `--`
    or `..`, no `.git` end), or None."""
    if not all(_HUB_NAME.fullmatch(part) for part in repo_id.split("/", 1)) or repo_id.count("/") != 1:
        return "names are ASCII letters, digits, '_', '.' and '-', starting and ending with a letter or digit"
    if "--" in repo_id or ".." in repo_id or repo_id.endswith(".git"):
        return "no '--' or '..' and no '.git' at the end"
    return None


def looks_like_repo_id(path: Any) -> bool:
    return (isinstance(path, str) and bool(_REPO_ID.fullmatch(path)) and not os.path.exists(path)
            and not path.endswith(".safetensors"))


def local_path(path: Any) -> Any:
    """`path` itself, or for a repo id not on disk its cached snapshot directory."""
    if not looks_like_repo_id(path):
        return path
    fetch = (f"fetch it first with `hf download {path} --include '*.safetensors' '*.json'` (or "
             f"huggingface_hub.snapshot_download({path!r}, allow_patterns=['*.safetensors', '*.json'])), then pass "
             "the repo id or the directory it prints; lazyload never downloads")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise CheckpointError(f"{path}: no such file or directory. As a Hugging Face repo id it needs huggingface_hub "
                              f"(pip install huggingface_hub): {fetch}.") from None
    try:
        return snapshot_download(path, local_files_only=True)
    except LocalEntryNotFoundError:
        from huggingface_hub import constants

        raise CheckpointError(f"{path}: no such file or directory, and not in the local Hugging Face cache "
                              f"({constants.HF_HUB_CACHE}); {fetch}.") from None
    except Exception as exc:  # an id huggingface_hub refuses (HFValidationError), an unreadable cache
        raise CheckpointError(f"{path}: no such file or directory, and huggingface_hub cannot look it up as a repo "
                              f"id ({type(exc).__name__}: {exc}); pass a directory, a file, a list or a glob.") from exc
