"""`lazyload inspect PATH` and `lazyload plan PATH --world N` (from headers only), and
`lazyload reshard SRC OUT --world N` (writes a pre-sharded copy). Every failure is one line
on stderr and exit status 2."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
import warnings
from typing import Iterator

PATH_HELP = ("the checkpoint: a directory, a .safetensors file, an index or description json, a glob, a Hugging "
             "Face repo id already in the local cache, or a URL (s3://bucket/prefix/, https://host/path/, "
             "hf://org/repo[@revision])")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30, "t": 2**40, "tib": 2**40}


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (the usage is in --help)."""

    def error(self, message: str) -> None:
        from .redact import redact  # it may quote an argument: a URL with its signature

        self.exit(2, f"{self.prog}: error: {redact(message)} (see {self.prog} --help)\n")


def byte_count(text: str) -> int:
    """'1GB' (10^9), '1GiB' or '1G' (2^30), '512MiB', '4096': a number of bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is no size; write e.g. 4096, 500MB, 1GB, 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = _Parser(prog="lazyload", description="Look into a safetensors checkpoint and plan or write its "
                                                  "tensor-parallel split, from the headers alone.")
    parser.add_argument("--version", action="version", version=f"lazyload {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    world = "the number of tensor-parallel ranks"
    config = "the model's config.json or the directory holding it (default: the checkpoint's)"
    plan = "'tp', 'ep', or a JSON object of glob -> transformers TP style"
    p = sub.add_parser("inspect", help="tensors, dtypes, shapes, bytes per file and per layer (headers only)")
    p.add_argument("path", help=PATH_HELP)
    _iteration_option(p)
    p = sub.add_parser("plan", help="per rank bytes to read, tensors and warnings for a TP world (headers only); "
                                    "a rank that cannot fit this host's memory is an error, as load_into refuses it "
                                    "(LAZYLOAD_FIT_CHECK=0: plan for another host)")
    p.add_argument("path", help=PATH_HELP)
    _iteration_option(p)
    p.add_argument("--world", type=int, required=True, help=world)
    p.add_argument("--config", default=None, help=config + "; for a URL, the one its store holds")
    p.add_argument("--single-file", action="store_true",
                   help="plan one shard of a checkpoint of several files alone (otherwise an error: pass the "
                        "directory)")
    p.add_argument("--plan", default=None, help=plan)
    p.add_argument("--quantize", default=None, metavar="KIND",
                   help="int8 or fp8: quantize Linear layers and MoE experts on load, as load_into(quantize=...); "
                        "nvfp4, mxfp4, int4 or int4:gN (groups of N): Linear layers to 4 bits, kept packed; keep: a 4-bit "
                        "checkpoint held packed as stored")
    p.add_argument("--dtype", default=None,
                   help="the dtype tensors are loaded in ('auto', 'bfloat16', 'float16', ...; default the model's)")
    p.add_argument("--json", action="store_true",
                   help="print every rank's whole plan (targets, placements, read items, ...) and its digest as JSON")
    p = sub.add_parser("reshard", help="write SRC pre-sharded for a TP world: one safetensors file per rank")
    p.add_argument("src", help="the checkpoint to read: " + PATH_HELP.removeprefix("the checkpoint: "))
    p.add_argument("out", help="a new or empty directory to write to (never SRC; see --overwrite)")
    _iteration_option(p)
    p.add_argument("--world", type=int, required=True, help=world + " to write for")
    p.add_argument("--plan", default=None, help=plan)
    p.add_argument("--config", default=None, help=config)
    p.add_argument("--max-file-bytes", type=byte_count, default=None,
                   help="cut a rank's file by layer past this size: bytes, or with a unit (500MB, 1GB = 10^9, "
                        "1GiB = 2^30)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it already holds files (never SRC)")
    p.add_argument("--quantize", choices=["int8", "fp8", "nvfp4", "int4"], default=None,
                   help="write a compressed-tensors checkpoint (with --world 1) whose Linear weights are quantized "
                        "as load_into(quantize=...) quantizes them, which transformers and vLLM load (nvfp4: "
                        "nvfp4-pack-quantized; int4: pack-quantized, groups of --group-size)")
    p.add_argument("--group-size", type=_group_size, default=None, metavar="G",
                   help="with --quantize: input columns per scale (default 128; a weight's columns must be whole "
                        "groups), or 'none' for one scale per row")
    p.add_argument("--skip", action="append", default=[], metavar="REGEX",
                   help="with --quantize: keep the Linear layers whose names match REGEX in full precision "
                        "(repeatable), beside lm_head and MoE routers")
    return parser


def _iteration_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--iteration", type=int, default=None, metavar="N",
                   help="of a Megatron save directory, the iteration iter_NNNNNNN/ to read (default: the latest, "
                        "as latest_checkpointed_iteration.txt names it)")


def _group_size(text: str) -> int:
    """A number of columns; 'none' (one scale per row) is 0."""
    if text.strip().lower() == "none":
        return 0
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is no group size; write a positive number of columns, or none")
    return int(text)


@contextlib.contextmanager
def _quiet_imports() -> Iterator[None]:
    """Third-party modules print as they import (torchao's kernels it cannot load, torch's
    deprecations, DeepSpeed's accelerator guess), none of it about the checkpoint: imported
    with stdout and stderr pointed at a file, left as they are with LAZYLOAD_DEBUG=1."""
    if os.environ.get("LAZYLOAD_DEBUG"):
        yield
        return
    with tempfile.TemporaryFile() as sink, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saved = [os.dup(1), os.dup(2)]
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(sink.fileno(), 1), os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            os.close(saved[0]), os.close(saved[1])


def _import_quietly(command: str) -> None:
    """What `command` imports, before it runs: the previews, and for `plan` and `reshard`
    transformers with the quantizers it imports when it builds a model."""
    with _quiet_imports():
        from . import summary  # noqa: F401
        if command != "inspect":
            try:
                import transformers.quantizers.auto  # noqa: F401  (imports torchao, DeepSpeed where installed)
            except ImportError:
                pass  # not installed: the command says so when it needs it


def _run(args: argparse.Namespace) -> str:
    _import_quietly(args.command)
    from .summary import format_plan, inspect_checkpoint

    plan = json.loads(args.plan) if getattr(args, "plan", None) and args.plan.lstrip().startswith("{") else (
        getattr(args, "plan", None))
    if args.command == "reshard":
        from .errors import ArgumentError
        from .quant.onload import Quantization
        from .stored import StoredCheckpoint
        from .writers import save_sharded

        if args.quantize is None and (args.skip or args.group_size is not None):
            raise ArgumentError("--group-size and --skip describe the quantization: pass --quantize "
                                "int8|fp8|nvfp4|int4 too.")
        group = 128 if args.group_size is None else args.group_size or None
        quantize = args.quantize and Quantization(args.quantize, group_size=group, skip=tuple(args.skip))
        src = args.src if args.iteration is None else StoredCheckpoint(args.src, iteration=args.iteration)
        return save_sharded(src, args.out, args.world, plan, config=args.config,
                            max_file_bytes=args.max_file_bytes, overwrite=args.overwrite, quantize=quantize)
    if args.command == "plan":
        return format_plan(args.path, args.world, args.config, single_file=args.single_file, plan=plan,
                           quantize=args.quantize, dtype=args.dtype, as_json=args.json, iteration=args.iteration)
    return inspect_checkpoint(args.path, args.iteration)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error already printed
        return exc.code if isinstance(exc.code, int) else 2
    from .errors import LazyLoadError

    try:
        text = _run(args)
    except LazyLoadError as exc:
        return _fail(str(exc))
    except ImportError as exc:  # `plan` builds the model with transformers
        return _fail(f"{exc.name or exc} is not installed; pip install transformers accelerate.")
    except json.JSONDecodeError as exc:
        return _fail(f"--plan {args.plan!r} is no JSON object ({exc}); pass 'tp', 'ep' or {{\"glob\": \"style\"}}.")
    except OSError as exc:
        return _fail(f"{exc.filename or ''}: {exc.strerror or exc}".lstrip(": "))
    except KeyboardInterrupt:
        return _fail("interrupted")
    except Exception as exc:  # a bug: still one line; LAZYLOAD_DEBUG=1 shows the traceback
        if os.environ.get("LAZYLOAD_DEBUG"):
            raise
        return _fail(f"unexpected {type(exc).__name__}: {exc} (a bug in lazyload: please report it, with the "
                     "traceback LAZYLOAD_DEBUG=1 prints)")
    return _print(text)


def _fail(message: str) -> int:
    from .redact import redact  # what names a location may name a credential: never shown

    print(f"lazyload: error: {redact(' '.join(message.split()))}", file=sys.stderr)
    return 2


def _print(text: str) -> int:
    """Print (redacted: an URL's signature or token is never shown); a reader that stops
    early (`| head`) is no failure and no traceback."""
    from .redact import redact

    try:
        print(redact(text), flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
