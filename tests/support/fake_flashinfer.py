"""A stand-in for the flashinfer module on the CPU: the FlashInfer tests' fake wrappers, put
where the backend looks the module up, and FlashInfer reported usable."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from backends.flashinfer import ops as fi_ops
from backends.flashinfer import wrappers


def install_fake_flashinfer(monkeypatch: pytest.MonkeyPatch, **classes: type) -> SimpleNamespace:
    """``classes``: the wrapper classes by their flashinfer names
    (``BatchDecodeWithPagedKVCacheWrapper``, ``BatchMLAPagedAttentionWrapper``); the module."""
    module = SimpleNamespace(**classes)
    monkeypatch.setattr(wrappers, "_module", module)
    monkeypatch.setattr(fi_ops, "flashinfer_usable", lambda device: True)
    return module
