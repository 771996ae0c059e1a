"""Graph-capturable integer kernels that turn a batch into attention metadata.

Each kernel exists twice: ``generic_torch`` is the exact reference and the fallback
on any device, ``generic_triton`` is the fast path. They share one contract (write
every element of a caller-owned ``out``, never sync with the host) so a plan can
swap one for the other without changing what a captured CUDA graph replays.
"""
