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


_CUTS_KEPT = 1024
"""Buffer views kept per runner: (input, real rows, graph rows) triples seen in serving, a
few per captured size; past it the oldest goes."""


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
        # What check and fill read of each input, unpacked once (the per-step hot path).
        self._rules = tuple(
            (name, spec.dtype, spec.per == "rows", tuple(spec.shape))
            for name, spec in self.specs.items()
        )
        self._fills = tuple(
            (i, name, self.buffers[name], spec.per == "rows", spec.pad)
            for i, (name, spec) in enumerate(self.specs.items())
        )
        self._cuts: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}

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
        if inputs.keys() != self.specs.keys():
            missing = sorted(set(self.specs) - set(inputs))
            unknown = sorted(set(inputs) - set(self.specs))
            if missing or unknown:
                raise BatchError(
                    "model inputs do not match the runner's static_inputs",
                    field="inputs",
                    expected=sorted(self.specs),
                    actual=sorted(inputs),
                )
        for name, dtype, per_rows, trailing in self._rules:
            tensor = inputs[name]
            # the hot path: one expression for a good input (torch.Size equals a tuple)
            if (
                isinstance(tensor, torch.Tensor)
                and tensor.dtype == dtype
                and tensor.shape == ((rows if per_rows else reqs), *trailing)
            ):
                continue
            self._refuse(name, tensor, reqs, rows)

    def _refuse(self, name: str, tensor: object, reqs: int, rows: int) -> None:
        """Name what is wrong with one input: its type, then its shape, then its dtype."""
        spec = self.specs[name]
        if not isinstance(tensor, torch.Tensor):
            raise BatchError("not a tensor", field=f"inputs.{name}", actual=type(tensor).__name__)
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
        self.fill_checked(inputs, reqs, rows, padded_reqs, padded_rows)

    def fill_checked(
        self,
        inputs: Mapping[str, torch.Tensor],
        reqs: int,
        rows: int,
        padded_reqs: int,
        padded_rows: int,
    ) -> None:
        """:meth:`fill` of inputs :meth:`check` has just passed with these counts (the runner
        checks them before the planner refresh, so a bad input changes no plan): the same
        check again would only cost host time."""
        for i, name, buf, per_rows, pad in self._fills:
            n, total = (rows, padded_rows) if per_rows else (reqs, padded_reqs)
            head, tail = self._cut(i, buf, n, total)
            # non_blocking: a device input stays on the stream, a pageable host one is staged
            # by the driver before this returns; neither waits for the previous graph.
            head.copy_(inputs[name], non_blocking=True)
            if tail is not None:
                tail.fill_(pad)

    def _cut(
        self, i: int, buf: torch.Tensor, n: int, total: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Views of buffer ``i``: its first ``n`` rows and the padding up to ``total`` (None
        when there is none). Kept per (buffer, n, total), a bounded number: slicing a tensor
        costs a microsecond, a dict look-up a twentieth of it."""
        key = (i, n, total)
        cut = self._cuts.get(key)
        if cut is None:
            cut = (buf[:n], buf[n:total] if total > n else None)
            if len(self._cuts) >= _CUTS_KEPT:
                del self._cuts[next(iter(self._cuts))]  # the oldest
            self._cuts[key] = cut
        return cut

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
