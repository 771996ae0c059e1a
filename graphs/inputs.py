"""Model inputs beyond the plans (``input_ids``, ...), in static buffers the runner owns.

A graph reads the addresses it was captured with, so every per-step input
lives in one buffer sized for the largest captured batch; each step copies
the real rows in and writes the pad value into the padding rows, so padded
rows never carry a previous batch's tokens into the model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from planner.errors import BatchError, ConfigError


@dataclass(frozen=True)
class InputSpec:
    """One model input: dtype, trailing shape, whether it has a row per token or per request, pad."""

    dtype: torch.dtype
    shape: tuple[int, ...] = ()
    per: Literal["rows", "reqs"] = "rows"
    pad: int | float = 0


def as_specs(specs: Mapping[str, InputSpec | torch.dtype] | None) -> dict[str, InputSpec]:
    """Normalise a spec mapping; a bare dtype means one value per row, padded with 0."""
    out: dict[str, InputSpec] = {}
    for name, spec in (specs or {}).items():
        if isinstance(spec, torch.dtype):
            spec = InputSpec(spec)
        if not isinstance(spec, InputSpec):
            raise ConfigError(
                "static input spec must be an InputSpec or a dtype",
                field=f"static_inputs.{name}",
                actual=spec,
            )
        if spec.per not in ("rows", "reqs"):
            raise ConfigError(
                "static input 'per' must be 'rows' or 'reqs'",
                field=f"static_inputs.{name}",
                actual=spec.per,
            )
        out[name] = spec
    return out


class StaticInputs:
    """The runner's input buffers, and the per-step copy into them."""

    def __init__(
        self, specs: Mapping[str, InputSpec], max_reqs: int, max_rows: int, device: torch.device
    ) -> None:
        self.specs = dict(specs)
        self.device = device
        self.buffers = {
            name: torch.full(
                ((max_rows if spec.per == "rows" else max_reqs), *spec.shape),
                spec.pad,
                dtype=spec.dtype,
                device=self.device,
            )
            for name, spec in self.specs.items()
        }

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers.values())

    def views(self, reqs: int, rows: int) -> dict[str, torch.Tensor]:
        """The leading ``rows`` / ``reqs`` of every buffer: what a graph of that size reads."""
        return {
            name: buf[: rows if self.specs[name].per == "rows" else reqs]
            for name, buf in self.buffers.items()
        }

    def check(self, inputs: Mapping[str, torch.Tensor], reqs: int, rows: int) -> None:
        """Names, dtypes and shapes must match the spec: the eager and graph paths must see the same."""
        missing = sorted(set(self.specs) - set(inputs))
        unknown = sorted(set(inputs) - set(self.specs))
        if missing or unknown:
            raise BatchError(
                "model inputs do not match the runner's static_inputs",
                field="inputs",
                expected=sorted(self.specs),
                actual=sorted(inputs),
            )
        for name, spec in self.specs.items():
            tensor = inputs[name]
            if not isinstance(tensor, torch.Tensor):
                raise BatchError(
                    "not a tensor", field=f"inputs.{name}", actual=type(tensor).__name__
                )
            want = ((rows if spec.per == "rows" else reqs), *spec.shape)
            if tuple(tensor.shape) != want:
                raise BatchError(
                    "wrong shape", field=f"inputs.{name}", expected=want, actual=tuple(tensor.shape)
                )
            if tensor.dtype != spec.dtype:
                raise BatchError(
                    "wrong dtype", field=f"inputs.{name}", expected=spec.dtype, actual=tensor.dtype
                )

    def fill(
        self,
        inputs: Mapping[str, torch.Tensor],
        reqs: int,
        rows: int,
        padded_reqs: int,
        padded_rows: int,
    ) -> None:
        """Copy the real rows in and pad the rest up to the graph's size."""
        self.check(inputs, reqs, rows)
        for name, buf in self.buffers.items():
            spec = self.specs[name]
            n, total = (rows, padded_rows) if spec.per == "rows" else (reqs, padded_reqs)
            # non_blocking: a device input stays on the stream, a pageable host one is staged
            # by the driver before this returns; neither waits for the previous graph.
            buf[:n].copy_(inputs[name], non_blocking=True)
            if total > n:
                buf[n:total].fill_(spec.pad)

    def pad(self, padded_reqs: int, padded_rows: int) -> None:
        """Every row is padding: the state warm-up and capture run with."""
        for name, buf in self.buffers.items():
            buf[: padded_rows if self.specs[name].per == "rows" else padded_reqs].fill_(
                self.specs[name].pad
            )

    def padding(self, reqs: int, rows: int) -> dict[str, torch.Tensor]:
        """Fresh inputs of ``reqs`` / ``rows`` entries, all padding: what an eager idle
        batch (planned as padding requests, so kernels never see an empty batch) is fed."""
        return {
            name: torch.full(
                ((rows if spec.per == "rows" else reqs), *spec.shape),
                spec.pad,
                dtype=spec.dtype,
                device=self.device,
            )
            for name, spec in self.specs.items()
        }
