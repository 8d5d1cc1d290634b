"""Projection layers by their last name: which are input (column-parallel) projections, which
output (row-parallel) ones, which fuse several parts, which are an attention's q or KV.

Read by tensor parallel's structural rule (`tp/structural.py`) and by the formats that must
know which dim a source rank split (`formats/deepspeed.py`), so it sits below both."""
from __future__ import annotations

# The last name of a Linear / Conv1D module (PACKED_NAMES: name -> its fused parts).
COLWISE_NAMES = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "fc1", "c_fc", "w1", "w3", "wq", "wk", "wv",
                 "query", "key", "value", "fc_in", "dense_h_to_4h", "q_lin", "k_lin", "v_lin", "lin1",
                 "Wq", "Wk", "Wv", "Wi", "w_0", "w_1",  # Wq...: CTRL; Wi: ModernBERT; w_0, w_1: CPM-Ant
                 "proj_up_gate", "proj_up"}  # xLSTM's feed-forward
ROWWISE_NAMES = {"o_proj", "down_proj", "fc2", "c_proj", "w2", "wo", "out_proj", "fc_out", "dense_4h_to_h", "out_lin",
                 "lin2", "Wo", "w_out", "proj_down"}
PACKED_NAMES = {"c_attn": 3, "qkv_proj": 3, "W_pack": 3, "gate_up_proj": 2}
KV_NAMES = {"k_proj", "v_proj", "key", "value", "wk", "wv", "k_lin", "v_lin", "Wk", "Wv"}
Q_NAMES = {"q_proj", "query", "wq", "q_lin", "Wq"}  # q_lin, k_lin, ...: XLM
