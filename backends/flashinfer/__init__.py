"""FlashInfer backends: paged decode (MHA/GQA) and DeepSeek MLA, planned once per batch.

This package never imports ``flashinfer`` at import time, so the planner's
registry (which imports every in-tree backend) works on any CPU.
"""
