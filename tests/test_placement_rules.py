"""The order in which a target's TP placement is decided is data: the rule tuples of
`tp/placements.py`, documented in that order, and a rule added to them from outside takes
its place in it (first answer wins)."""
from __future__ import annotations

from pathlib import Path

import torch

from checkpoints import build_model, make_config
from lazyload.plan import REPLICATE, Placement
from lazyload.tp import placements
from lazyload.tp.placements import Rule, plain_specs, resolve_placements

DOCUMENTED = ("autotp_fused", "autotp_layer", "local_as_planned", "local_plan_style", "local_even_share",
              "local_autotp", "dtensor", "user_plan", "model_plan", "structural")
Q = "model.layers.0.self_attn.q_proj.weight"


def _in_order(text: str, names) -> bool:
    positions = [text.find(f"`{name}`") for name in names]
    return -1 not in positions and positions == sorted(positions)


def test_the_rules_run_in_the_documented_order():
    names = tuple(rule.name for rule in placements.SPLIT_MADE + placements.PLAN_OF_OURS)
    assert names == DOCUMENTED
    assert _in_order(placements.__doc__, names)
    architecture = (Path(__file__).parents[1] / "docs" / "architecture.md").read_text()
    assert _in_order(architecture[architecture.index("### Placements and Plan"):], names)


def test_a_rule_added_from_outside_takes_effect_where_it_stands(monkeypatch):
    model = build_model("llama", make_config("llama"), torch.float32)
    specs = plain_specs(model)
    before = resolve_placements(model, specs, [], None, 0, 2).placements
    assert before[Q] == Placement("shard", 0)  # the model's own TP plan: q_proj colwise
    original, asked = placements.PLAN_OF_OURS, []

    def whole_q(context, target):
        asked.append(target.name)
        return REPLICATE if target.name == Q else None

    rule = Rule("whole_q", whole_q)
    monkeypatch.setattr(placements, "PLAN_OF_OURS", original + (rule,))
    assert resolve_placements(model, specs, [], None, 0, 2).placements == before  # model_plan answered first
    assert Q not in asked

    monkeypatch.setattr(placements, "PLAN_OF_OURS", (rule,) + original)
    after = resolve_placements(model, specs, [], None, 0, 2).placements
    assert after[Q] == REPLICATE
    assert {n: p for n, p in after.items() if n != Q} == {n: p for n, p in before.items() if n != Q}
