"""FreeToken's kernels: Triton kernels for the GPU side and the C executor's source.

Installed as ``freetoken_sglang.kernels``.
"""
