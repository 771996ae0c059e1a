"""The application built on the planner: DeepSeek-V3.2 served through a planner loop.

``models`` (the decoder, its MTP draft layer, the paged KV cache), ``serving`` (engine,
scheduler, speculative decoding, dumps, the ``python -m planner`` commands) and
``distributed`` (TP and DP attention on ``torch.distributed``) live under this one name,
so installing the wheel adds no generic top-level package beside ``planner``,
``backends`` and ``graphs``. Importing it imports nothing heavy.
"""

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
SHIPPED_CONFIGS = (
    _PACKAGE / "configs" if (_PACKAGE / "configs").is_dir() else _PACKAGE.parent / "configs"
)
"""The run configs selectable by name (``--config dsv32-tiny-spec``). They live in the
repository's top-level ``configs/``; a wheel installs them as this package's data
(``dsv32_engine/configs``, mapped in ``setup.py``), so the installed copy comes first and a
source checkout (``pip install -e .`` or ``PYTHONPATH``) reads the folder itself."""
