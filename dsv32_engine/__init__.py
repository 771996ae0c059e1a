"""The application built on the planner: DeepSeek-V3.2 served through a planner loop.

``models`` (the decoder, its MTP draft layer, the paged KV cache), ``serving`` (engine,
scheduler, speculative decoding, dumps, the ``python -m planner`` commands) and
``distributed`` (TP and DP attention on ``torch.distributed``) live under this one name,
so installing the wheel adds no generic top-level package beside ``planner``,
``backends`` and ``graphs``. Importing it imports nothing heavy.
"""

from pathlib import Path

SHIPPED_CONFIGS = Path(__file__).resolve().parent / "configs"
"""The run configs shipped as package data, selectable by name (``--config dsv32-tiny-spec``)."""
