"""Each rank's share of the parameters under the default plan, for every causal LM class of
the installed transformers (small configs on the meta device: no checkpoint, no process).

    python benchmarks/bench_plan_shares.py --world 2 --json shares.json
    python benchmarks/bench_plan_shares.py --compare shares-5.24.json shares-5.25.json
    python benchmarks/bench_plan_shares.py --plan tp --json tp.json    # the TP plan as it is

The plan is `resolve_placements` with `plan=None`, as `load_into` resolves it on rank 0 of
`world`: the share is this rank's elements over the model's. Run it under two transformers
versions and `--compare` the two files: an architecture whose share grew holds more per
rank on the newer version (transformers 5.25 took MoE experts out of its TP plans; the
default plan splits them by expert instead).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def share(class_name: str, model_type: str, world: int, plan=None) -> dict:
    """{'share': rank 0's elements / all, 'plan': "tp"/"ep"} or {'error': ...}."""
    import torch
    import transformers
    from transformers import CONFIG_MAPPING

    from lazyload.plan import REPLICATE, local_regions
    from lazyload.targets import model_slots, model_specs
    from lazyload.tp.placements import resolve_placements
    from lazyload.tp.styles import default_experts
    from sweep_architectures import _default_config, _for_class, shrink

    cls = getattr(transformers, class_name)
    config_class = cls.config_class or CONFIG_MAPPING[model_type]
    config = _for_class(shrink(_default_config(model_type, config_class)), class_name)
    with torch.device("meta"):
        model = cls(config)
    specs = model_specs(model, model_slots(model)[0])
    placements = resolve_placements(model, specs, [], plan, 0, world).placements
    held = total = 0
    for name, spec in specs.items():
        n = math.prod(spec.shape)
        local, _ = local_regions(name, spec.shape, placements.get(name, REPLICATE), 0, world)
        held, total = held + math.prod(local), total + n
    return {"share": held / total, "plan": default_experts(model)}


def measure(world: int, plan=None) -> dict:
    import transformers

    from sweep_architectures import model_classes

    rows = {"transformers": transformers.__version__}
    for model_type, class_name in model_classes(causal_lm=True):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                rows[class_name] = share(class_name, model_type, world, plan)
        except Exception as exc:  # noqa: BLE001 (a class no small config makes, or no plan can split: a row)
            rows[class_name] = {"error": f"{type(exc).__name__}: {str(exc)[:120]}"}
    return rows


def compare(old_path: str, new_path: str) -> str:
    old, new = (json.load(open(p)) for p in (old_path, new_path))
    lines = [f"| class | share on {old['transformers']} | share on {new['transformers']} | plan on "
             f"{new['transformers']} |", "|---|---|---|---|"]
    grew = same = 0
    for name in sorted(set(old) & set(new) - {"transformers"}):
        a, b = old[name], new[name]
        if "share" not in a or "share" not in b:
            continue
        if b["share"] > a["share"] + 1e-9:
            grew += 1
        same += abs(b["share"] - a["share"]) <= 1e-9
        if abs(b["share"] - a["share"]) > 1e-9 or b["plan"] == "ep":
            lines.append(f"| {name} | {a['share']:.3f} | {b['share']:.3f} | {b['plan']} |")
    both = sum(1 for n in set(old) & set(new) - {"transformers"} if "share" in old[n] and "share" in new[n])
    lines.append(f"\n{both} classes planned on both; {same} hold the same share, {grew} hold more on "
                 f"{new['transformers']}.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--plan", choices=("tp", "ep"), help="plan= instead of the default (None)")
    parser.add_argument("--json", help="write every row here")
    parser.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), help="two --json files")
    args = parser.parse_args()
    if args.compare:
        print(compare(*args.compare))
        return
    rows = measure(args.world, args.plan)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    planned = [r["share"] for r in rows.values() if isinstance(r, dict) and "share" in r]
    print(f"transformers {rows['transformers']}, world {args.world}: {len(planned)} classes planned, "
          f"median share {sorted(planned)[len(planned) // 2]:.3f}")


if __name__ == "__main__":
    main()
