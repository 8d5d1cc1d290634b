"""Tensor parallel at world 2 (gloo) for causal LMs that lazyload's structural rule makes
runnable, and for those whose own transformers plan lazyload has to complete, each
family's small model from the architecture sweep
(benchmarks/sweep_architectures.py): the logits equal world 1's, within the order a
row-parallel all-reduce sums in.

Every family runs in one spawned job (spawning is the expensive part on 2 cores)."""
from __future__ import annotations

import torch

from lazyload.plan import Placement

from gloo import spawn_cases
from test_sweep import sweep

# class -> (anything split at world 2, what it covers)
FAMILIES = {
    "BertLMHeadModel": (True, "BERT layout: attention.self q/k/v -> attention.output.dense, intermediate -> output"),
    "OPTForCausalLM": (True, "views with num_heads: the attention's head count made local"),
    "XGLMForCausalLM": (True, "num_heads in views and in attention weight shapes"),
    "GPTBigCodeForCausalLM": (True, "multi-query fused c_attn: attention replicated, MLP split"),
    "MptForCausalLM": (True, "fused Wqkv the rule does not split: its out_proj replicated too, MLP split"),
    "MoshiForCausalLM": (True, "fc1 = gate|up fused (twice fc2's input): split as two packed parts"),
    "MambaForCausalLM": (False, "out_proj that no colwise layer feeds: replicated (the model runs whole)"),
    "CTRLLMHeadModel": (True, "Wq/Wk/Wv -> the attention's `dense`"),
    "ModernBertDecoderForCausalLM": (True, "Wi = gate|up fused -> Wo; attention's Wo"),
    "CpmAntForCausalLM": (True, "w_in.w_0 / w_in.w_1 -> w_out, a level apart; attention (position bias over all heads) whole"),
    "BigBirdForCausalLM": (True, "attention rebuilt from the config in the forward: whole; MLP split"),
    "TrOCRForCausalLM": (True, "attention reshaped to its input's width: whole; MLP split"),
    "xLSTMForCausalLM": (True, "feed-forward proj_up_gate/proj_up -> proj_down split; mLSTM cell (q/k/v, gates) whole"),
    # transformers' own plans
    "Inkling2ForCausalLM": (True, "experts' fused gate_up_proj under 'colwise': each rank its gates and its ups"),
    "InklingForCausalLM": (True, "normed embedding kept whole; shared experts' bare 3-D tensors run local"),
    "Qwen3NextForCausalLM": (True, "q_proj = q and a gate per head (twice as wide): KV groups kept; linear attention"),
    "JambaForCausalLM": (True, "hybrid: mamba layers and an attention layer, experts"),
    "DbrxForCausalLM": (True, "a plan that splits only lm_head: the fused-Wqkv attention keeps its own bookkeeping"),
    "BambaForCausalLM": (True, "hybrid: Mamba-2 layers and an attention layer"),
    "Gemma3nForCausalLM": (True, "MLPs with Gaussian top-k sparsity (statistics over the whole width) kept whole"),
    "DogeForCausalLM": (True, "plan splits dt_proj rowwise (the dynamic mask, one value per KV head): attention whole"),
    "Gemma4ForConditionalGeneration": (True, "forward reads embed_tokens.weight[pad_token_id]: that embedding whole"),
}


def _logits(directory, class_name, rank, world):
    import transformers

    from lazyload import LazyCheckpoint

    cls = getattr(transformers, class_name)
    config = cls.config_class.from_pretrained(directory)
    with torch.device("meta"):
        model = cls._from_config(config, attn_implementation="eager", dtype=torch.float32)
    LazyCheckpoint(directory).load_into(model.eval(), rank, world, progress=False)
    with torch.no_grad():
        return model(input_ids=sweep._prompt(config)).logits, model


def _case(case, rank, world):
    class_name, directory, split = case
    want, ref = _logits(directory, class_name, 0, 1)
    got, model = _logits(directory, class_name, rank, world)
    from torch.distributed.tensor import DTensor

    full = {n: p.shape for n, p in ref.named_parameters()}
    local = {n: (p.to_local() if isinstance(p, DTensor) else p).shape for n, p in model.named_parameters()}
    assert any(local[n] != full[n] for n in full) == split, f"{class_name}: split is not {split}"
    scale = max(float(want.abs().max()), 1.0)
    torch.testing.assert_close(got, want, rtol=0, atol=sweep.TP_TOLERANCE * scale, msg=lambda m: f"{class_name}: {m}")


def test_world2_structural_families_match_world1(tmp_path):
    classes = {cls: model_type for model_type, cls in sweep.model_classes(causal_lm=True)}
    cases = [(cls, sweep.write_small(classes[cls], cls, str(tmp_path)), split) for cls, (split, _) in FAMILIES.items()]
    spawn_cases(2, cases, tmp_path, _case)


def _rule(class_name):
    """The structural rule's placements at world 2 for the class's small model, on meta."""
    import transformers

    from lazyload.tp.placements import plain_specs, static_placements

    cls = getattr(transformers, class_name)
    with torch.device("meta"):
        model = cls(sweep.shrink(cls.config_class()))
    return {n.partition(".0.")[2]: p for n, p in static_placements(model, plain_specs(model), "tp", 2).items()
            if ".0." in n}


def test_structural_rule_splits_only_blocks_that_can_run():
    """A block is split only when its colwise layers feed a rowwise one that sums them, a
    fused q/k/v has three equal parts, and nothing beside the colwise layer needs its whole
    output width."""
    bert = _rule("BertLMHeadModel")
    assert {n: (p.kind, p.dim) for n, p in bert.items() if n.endswith("weight")} == {
        "attention.self.query.weight": ("shard", 0), "attention.self.key.weight": ("shard", 0),
        "attention.self.value.weight": ("shard", 0), "attention.output.dense.weight": ("shard", 1),
        "intermediate.dense.weight": ("shard", 0), "output.dense.weight": ("shard", 1)}
    bigcode = _rule("GPTBigCodeForCausalLM")  # multi-query c_attn: [q heads, one k head, one v head]
    assert sorted(bigcode) == ["mlp.c_fc.bias", "mlp.c_fc.weight", "mlp.c_proj.bias", "mlp.c_proj.weight"]
    assert _rule("BitNetForCausalLM") == {}  # attn_sub_norm / ffn_sub_norm over the whole width
    assert _rule("MambaForCausalLM") == {}  # out_proj without a colwise layer feeding it
    assert sorted({n.rpartition(".")[0] for n in _rule("OPTForCausalLM")}) == [
        "fc1", "fc2", "self_attn.k_proj", "self_attn.out_proj", "self_attn.q_proj", "self_attn.v_proj"]
    moshi = _rule("MoshiForCausalLM")  # fc1 is gate|up fused, twice fc2's input: split as two parts
    assert moshi["mlp.fc1.weight"] == Placement("packed", 0, parts=2) and moshi["mlp.fc2.weight"].dim == 1
    assert sorted({n.rpartition(".")[0] for n in _rule("XLMWithLMHeadModel")}) == [
        "k_lin", "lin1", "lin2", "out_lin", "q_lin", "v_lin"]  # attentions.0.*, ffns.0.*
    assert sorted({n.rpartition(".")[0] for n in _rule("TrOCRForCausalLM")}) == ["fc1", "fc2"]
    assert sorted({n.rpartition(".")[0] for n in _rule("BigBirdForCausalLM")}) == [
        "intermediate.dense", "output.dense"]
    assert sorted({n.rpartition(".")[0] for n in _rule("CpmAntForCausalLM")}) == [
        "ffn.ffn.w_in.w_0", "ffn.ffn.w_in.w_1", "ffn.ffn.w_out"]
    assert sorted({n.rpartition(".")[0] for n in _rule("xLSTMForCausalLM")}) == [
        "ffn.proj_down", "ffn.proj_up", "ffn.proj_up_gate"]  # mLSTM's out_proj: no colwise layer feeds it


def test_a_fused_gate_up_under_colwise_holds_both_halves():
    """transformers splits a converted tensor's sources before converting them, so Inkling's
    interleaved w13 under "colwise" gives each rank its gates and its ups; lazyload's
    placement says so directly. A gathered output keeps the contiguous split."""
    from lazyload.tp.styles import style_placement

    assert style_placement("colwise", "layers.0.mlp.experts.gate_up_proj", 3) == Placement("packed", 1, parts=2)
    assert style_placement("colwise", "layers.0.mlp.gate_up_proj.weight", 2) == Placement("packed", 0, parts=2)
    assert style_placement("colwise_gather_output", "layers.0.mlp.gate_up_proj.weight", 2) == Placement("shard", 0)
    assert style_placement("colwise", "layers.0.mlp.up_proj.weight", 2) == Placement("shard", 0)


def test_an_embedding_that_normalizes_its_rows_stays_whole():
    """transformers adds 'embedding_rowwise' to every nn.Embedding `embed_tokens`; Inkling's
    runs an RMSNorm on the looked-up rows before the ranks' partial rows are summed."""
    import transformers

    from lazyload.tp.styles import model_tp_plan

    plans = {}
    for name in ("InklingForCausalLM", "LlamaForCausalLM"):
        cls = getattr(transformers, name)
        with torch.device("meta"):
            plans[name] = model_tp_plan(cls(sweep.shrink(cls.config_class())))
    # left out (lazyload drops the entry), or "replicate" (transformers' own plan since 5.25)
    assert plans["InklingForCausalLM"].get("model.embed_tokens", "replicate") == "replicate"
    assert plans["LlamaForCausalLM"]["model.embed_tokens"] == "embedding_rowwise"
