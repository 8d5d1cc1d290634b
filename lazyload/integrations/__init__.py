"""Other engines as the destination of a load: vLLM (`integrations.vllm`), fed by lazy tensors
(`integrations.lazy_tensor`) whose copies lazyload reads box by box (`integrations.reads`)."""
