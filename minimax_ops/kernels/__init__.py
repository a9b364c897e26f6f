"""Triton kernels, each beside its Python wrapper. Wrappers launch on the current stream and
never synchronise with the host, so every one of them can be captured in a CUDA graph."""
