"""The application built on the planner: DeepSeek-V3.2 served through a planner loop.

``models`` (the decoder, its MTP draft layer, the paged KV cache), ``serving`` (engine,
scheduler, speculative decoding, dumps, the ``python -m planner`` commands) and
``distributed`` (TP and DP attention on ``torch.distributed``) live under this one name,
so installing the wheel adds no generic top-level package beside ``planner``,
``backends`` and ``graphs``. Importing it imports nothing heavy.
"""

from pathlib import Path


def configs_folder(package: Path) -> Path:
    """Where the configs of the package at ``package`` are: its own ``configs`` (a wheel's
    package data) when that holds any, else the checkout's top-level ``configs/``."""
    installed = package / "configs"
    return installed if any(installed.glob("*.yaml")) else package.parent / "configs"


SHIPPED_CONFIGS = configs_folder(Path(__file__).resolve().parent)
"""The run configs selectable by name (``--config dsv32-tiny-spec``). They live in the
repository's top-level ``configs/``; a wheel installs them as this package's data
(``dsv32_engine/configs``, mapped in ``setup.py``), so an installed copy comes first and a
source checkout (``pip install -e .`` or ``PYTHONPATH``) reads the folder itself; a folder
there without configs (one an older checkout left behind) is no installed copy."""
