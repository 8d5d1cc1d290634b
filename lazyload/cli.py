"""`lazyload inspect PATH` and `lazyload plan PATH --world N` (from headers only), and
`lazyload reshard SRC OUT --world N` (writes a pre-sharded copy)."""
from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lazyload")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="tensors, dtypes, shapes, bytes per file and per layer (headers only)")
    p.add_argument("path")
    p = sub.add_parser("plan", help="per rank bytes to read, tensors and warnings for a TP world (headers only)")
    p.add_argument("path")
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--config", default=None, help="config.json or its directory (default: the checkpoint's)")
    p = sub.add_parser("reshard", help="write SRC pre-sharded for a TP world: one safetensors file per rank")
    p.add_argument("src")
    p.add_argument("out")
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--plan", default=None, help="'tp', 'ep', or a JSON object of glob -> transformers TP style")
    p.add_argument("--config", default=None, help="config.json or its directory (default: the checkpoint's)")
    p.add_argument("--max-file-bytes", type=int, default=None, help="cut a rank's file by layer past this size")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it already holds files (never SRC)")
    args = parser.parse_args(argv)
    from .errors import LazyLoadError
    from .summary import format_plan, inspect_checkpoint

    try:
        if args.command == "reshard":
            from .writers import save_sharded

            plan = json.loads(args.plan) if args.plan and args.plan.lstrip().startswith("{") else args.plan
            print(save_sharded(args.src, args.out, args.world, plan, config=args.config,
                               max_file_bytes=args.max_file_bytes, overwrite=args.overwrite))
        elif args.command == "plan":
            print(format_plan(args.path, args.world, args.config))
        else:
            print(inspect_checkpoint(args.path))
    except LazyLoadError as exc:
        print(f"lazyload: error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:  # `plan` builds the model with transformers
        print(f"lazyload: error: {exc.name or exc} is not installed; pip install 'lazyload[hf]'.", file=sys.stderr)
        return 2
    return 0

if __name__ == "__main__":
    sys.exit(main())
