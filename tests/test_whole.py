"""Conversions outside lazyload's expression vocabulary (transformers' Interleave,
PermuteForRope, Split, ...): their sources are read whole and transformers' own operation
runs on the rank (`expr.Whole`). Each model loads exactly as `from_pretrained` loads it, the
report names what was read whole, and at world 2 (gloo) each rank holds world 1's slice."""
from __future__ import annotations

import pytest
import torch

from gloo import spawn_cases
from test_sweep import sweep

# model type, class, the operation it needs (for the reader of a failure)
CASES = [
    ("inkling2_text", "Inkling2TextModel"),                      # Interleave (experts' gate/up)
    ("inkling2_loop_text", "Inkling2LoopTextModel"),             # Inkling2LoopDequantizeExperts, Interleave
    ("kimi_k25", "Kimi_K25ForConditionalGeneration"),            # Chunk + PermuteForRope (vision q/k)
    ("lara_mini", "LaraMiniForCausalLM"),                        # Split by the targets' sizes
    ("molmo2_text", "Molmo2TextModel"),                          # Split (GQA q/k/v)
    ("ernie4_5_vl_moe", "Ernie4_5_VLMoeForConditionalGeneration"),  # ErnieFuseAndSplitTextVisionExperts
    ("step3p7", "Step3p7ForConditionalGeneration"),              # Chunk + PermuteForRope (vision in_proj weight, bias)
]


def _meta_model(cls_name: str, directory):
    import transformers

    cls = getattr(transformers, cls_name)
    config = cls.config_class.from_pretrained(directory)
    with torch.device("meta"):
        return cls._from_config(config, attn_implementation="eager", dtype=torch.float32).eval()


@pytest.mark.parametrize("model_type,cls", CASES, ids=[c for _, c in CASES])
def test_conversion_outside_the_vocabulary_loads_as_from_pretrained(model_type, cls, tmp_path):
    from lazyload import LazyCheckpoint

    row = sweep.sweep_one(model_type, cls, str(tmp_path))  # every tensor and the outputs vs from_pretrained
    assert row["outcome"] == "exact", row
    report = LazyCheckpoint(tmp_path / cls).load_into(_meta_model(cls, tmp_path / cls), progress=False)
    assert report.read_whole and set(report.read_whole) <= set(report.loaded)
    assert all(n > 0 for n in report.read_whole.values())
    assert "read whole" in str(report)


def test_the_budget_covers_what_a_whole_conversion_holds(tmp_path):
    """A max_host_bytes that fits every read but not a whole conversion is refused before
    anything is read, naming the tensor."""
    from lazyload import LazyCheckpoint, PlanError

    sweep.sweep_one("inkling2_text", "Inkling2TextModel", str(tmp_path))
    directory = tmp_path / "Inkling2TextModel"
    model = _meta_model("Inkling2TextModel", directory)
    report = LazyCheckpoint(directory).load_into(_meta_model("Inkling2TextModel", directory), progress=False)
    largest = max(report.read_whole.values())  # bytes read whole for one target: one read each here
    with pytest.raises(PlanError, match="gate_up_proj.*whole source tensors"):
        LazyCheckpoint(directory).load_into(model, max_host_bytes=largest, progress=False)
    assert all(p.is_meta for p in model.parameters())


def _case_world2(case, rank, world):
    """Under the process group: each rank's shard of a target computed whole equals its slice
    of the world-1 tensor."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from lazyload import LazyCheckpoint

    directory, cls_name, plan = case
    ref = _meta_model(cls_name, directory)
    LazyCheckpoint(directory).load_into(ref, progress=False)
    model = _meta_model(cls_name, directory)
    report = LazyCheckpoint(directory).load_into(model, rank, world, plan=plan, progress=False)
    assert report.read_whole
    want = dict(ref.named_parameters())
    sharded = 0
    for name in report.read_whole:
        param = model.get_parameter(name)
        assert isinstance(param, DTensor), f"{name} was not made tensor parallel"
        local, expected = param.to_local(), want[name].detach()
        for placement in param.placements:
            if isinstance(placement, (Shard, _StridedShard)):  # strided: a fused gate|up, a slice of each part
                parts = getattr(placement, "split_factor", 1)
                expected = torch.cat([part.chunk(world, placement.dim)[rank]
                                      for part in expected.chunk(parts, placement.dim)], placement.dim)
                sharded += 1
        assert torch.equal(local, expected), f"{name}: rank {rank}'s shard is not world 1's slice"
    assert sharded, "no target computed whole was sharded"


def test_world_2_ranks_hold_world_1_slices_of_a_whole_conversion(tmp_path):
    """Inkling2's experts' gate_up_proj (an Interleave of the checkpoint's w13), column-parallel
    as transformers 5.24's TP plan split it: each rank reads w13 whole, interleaves, keeps its
    slice of the gates and of the ups; by default (whole experts per rank), its experts."""
    sweep.sweep_one("inkling2_text", "Inkling2TextModel", str(tmp_path))
    directory = str(tmp_path / "Inkling2TextModel")
    inside = {"layers.*.mlp.experts.gate_up_proj": "colwise", "layers.*.mlp.experts.down_proj": "rowwise",
              "layers.*.mlp.experts": "moe_tp_experts"}
    spawn_cases(2, [(directory, "Inkling2TextModel", inside), (directory, "Inkling2TextModel", None)], tmp_path,
                _case_world2)
