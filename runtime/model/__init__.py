"""The model: Llama-family forward (llama), config, weights loading and conversion, ops, kernels."""
