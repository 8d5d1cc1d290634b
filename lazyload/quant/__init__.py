"""Pre-quantized checkpoints: which tensors are quantized weights and with which scales
(`formats`), and the exact, vectorised dequantization of a read box (`dequant`)."""
