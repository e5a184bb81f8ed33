"""The frozen target and its capture: load the model, fused kernels per family, packed (varlen) attention,
replicas over several GPUs, the hooks that capture hidden states (and quantize them to fp8 on the device), the out-of-memory backoff, the token budget its
memory allows.

May import: `plan`, `data`, `recipe` and the ground floor.
"""
