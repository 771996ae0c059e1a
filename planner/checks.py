"""The checks of a batch the host makes: its structure, at the door.

The door (:func:`validate_batch`) checks types, ranks, devices, lengths, counts and the mode
on the host, from shapes and the host lengths, before anything is written or launched, and the
arguments that name a bucket. Every check of a batch's values (ranges, repeated slots or
requests, positions against lengths, token table entries) runs on the device, where the
values are read anyway (``planner.device_checks``).
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Mapping

import torch

from planner.batch import RAGGED_MODES, UNIFORM_MODES, ForwardBatch, ForwardMode
from planner.errors import BatchError

_INDEX_DTYPES = (torch.int32, torch.int64)
_INT32_ONLY = (torch.int32,)
_CPU = torch.device("cpu")
_UNIFORM_IMPLIED = frozenset(m for m in ForwardMode if not m.ragged and not m.padded_rows)
"""Modes whose batches may leave ``extend_lens_cpu`` out: ``bs * next_n`` tokens."""
_SHAPES = [m for m in ForwardMode if m in UNIFORM_MODES and m is not ForwardMode.IDLE]
"""What an idle batch may be shaped as (``idle_as``): the uniform modes, in enum order."""


def _check_tensor(
    name: str,
    tensor: object,
    dtypes: tuple[torch.dtype, ...],
    rank: int,
    devices: tuple[torch.device, ...],
    length: int | None = None,
) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise BatchError(
            "not a tensor", field=name, expected="torch.Tensor", actual=type(tensor).__name__
        )
    if tensor.dtype not in dtypes:
        raise BatchError(
            "wrong dtype", field=name, expected=" or ".join(map(str, dtypes)), actual=tensor.dtype
        )
    if tensor.dim() != rank:
        raise BatchError("wrong rank", field=name, expected=rank, actual=tensor.dim())
    if tensor.device not in devices:
        raise BatchError(
            "wrong device",
            field=name,
            expected=" or ".join(map(str, devices)),
            actual=tensor.device,
        )
    if not tensor.is_contiguous():
        raise BatchError(
            "not contiguous", field=name, expected="contiguous", actual=tuple(tensor.stride())
        )
    if length is not None and tensor.shape[0] != length:
        raise BatchError("wrong length", field=name, expected=length, actual=tensor.shape[0])
    return tensor


def validate_batch(
    batch: ForwardBatch,
    *,
    device: torch.device,
    max_batch: int,
    max_tokens: int,
    next_n: Mapping[ForwardMode, int],
    planned: Collection[ForwardMode],
    device_reads: bool,
) -> tuple[ForwardMode, ForwardMode, int]:
    """Reject a malformed batch, naming the field, before anything is staged; its mode, the
    mode that plans it (an idle batch's shape) and its query tokens (summed here once: a
    ragged replay's bucket check reads them).

    Structure only (types, ranks, devices, lengths, counts): value ranges are
    checked where the inputs are staged. ``next_n`` is each mode's tokens per
    request (absent: 1); ``planned`` the modes with a program (an idle batch's
    shape must be one). ``device_reads`` also compares the engine's device
    copies of the lengths with the host ones, which costs a synchronisation:
    eager ``plan()`` and debug mode pay it, replay not.
    """
    if not isinstance(batch, ForwardBatch):
        raise BatchError("not a ForwardBatch", field="batch", actual=type(batch).__name__)
    mode = batch.mode
    if not isinstance(mode, ForwardMode):  # a plain string: the enum call, and its refusal
        try:
            mode = ForwardMode(mode)
        except ValueError:
            raise BatchError(
                "unknown mode",
                field="mode",
                expected=[m.value for m in ForwardMode],
                actual=batch.mode,
            ) from None
    shape = batch.idle_as
    if shape is not ForwardMode.DECODE:  # an idle batch of another shape, or a wrong one
        shape = _check_shape(mode, shape, planned)
    want_n = next_n.get(mode if shape is ForwardMode.DECODE else shape, 1)
    if batch.next_n != want_n:
        what = mode.value if mode is not ForwardMode.IDLE else f"idle as {shape.value}"
        raise BatchError(
            f"next_n does not match the planner for mode {what} (its tokens per request)",
            field="next_n",
            expected=want_n,
            actual=batch.next_n,
        )
    if device.type == "cpu":  # any host device ("cpu:0") takes host tensors
        device = _CPU
    on_device = (device,)
    both = (_CPU, device) if device != _CPU else (_CPU,)
    seq = _check_tensor("seq_lens_cpu", batch.seq_lens_cpu, _INT32_ONLY, 1, (_CPU,))
    bs = seq.shape[0]
    if bs == 0 or mode is ForwardMode.IDLE:
        _check_idle(mode, bs)
    if bs > max_batch:
        raise BatchError(
            "batch larger than max_batch",
            field="seq_lens_cpu",
            expected=f"<= {max_batch}",
            actual=bs,
        )
    lens = batch.extend_lens_cpu
    if lens is None and mode in _UNIFORM_IMPLIED:  # decode, verify: bs * next_n tokens
        tokens = bs * batch.next_n
    else:
        tokens = _check_extend_lens(batch, mode, bs, max_tokens)
    if mode is ForwardMode.DRAFT_DECODE and bs and int(seq.min()) < batch.next_n:
        raise BatchError(
            "a draft-decode batch's KV lengths include its k draft tokens (its first step's "
            "length is seq_lens_cpu - k + 1 >= 1)",
            field="seq_lens_cpu",
            expected=f">= {batch.next_n}",
            actual=int(seq.min()),
        )
    _check_tensor("req_to_token", batch.req_to_token, _INT32_ONLY, 2, on_device)
    _check_tensor("req_pool_indices", batch.req_pool_indices, _INDEX_DTYPES, 1, both, bs)
    _check_tensor("out_cache_loc", batch.out_cache_loc, _INDEX_DTYPES, 1, both, tokens)
    if batch.positions is not None:
        _check_tensor("positions", batch.positions, _INDEX_DTYPES, 1, both, tokens)
    if lens is not None and bs and mode not in RAGGED_MODES and int(lens.max()) > batch.next_n:
        # a uniform batch has next_n rows per request: more tokens would not fit them
        raise BatchError(
            f"a {mode.value} request adds at most next_n tokens",
            field="extend_lens_cpu",
            expected=f"<= {batch.next_n}",
            actual=int(lens.max()),
        )
    if batch.seq_lens is not None or batch.extend_lens is not None:
        _check_device_lens(batch, seq, bs, on_device, device_reads)
    return mode, shape if mode is ForwardMode.IDLE else mode, tokens


def _check_shape(mode: ForwardMode, value: object, planned: Collection[ForwardMode]) -> ForwardMode:
    """An ``idle_as`` other than decode: only an idle batch declares one, a uniform mode
    that has a program (it is planned with that mode's program and replays its graphs)."""
    if value == ForwardMode.DECODE:  # "decode" as a string (a str enum)
        return ForwardMode.DECODE
    if mode is not ForwardMode.IDLE:
        why = f"only an idle batch is shaped as another mode: a {mode.value} batch plans as itself"
        expected: object = ForwardMode.DECODE.value
    elif value not in _SHAPES:
        why = "an idle batch pads the graph of a uniform mode (ragged batches have none)"
        expected = [m.value for m in _SHAPES]
    elif ForwardMode(value) not in planned:
        why = "the planner does not plan the mode this idle batch is shaped as" + (
            " (draft decode needs Limits.draft_steps >= 1)"
            if value == ForwardMode.DRAFT_DECODE
            else ""
        )
        expected = [m.value for m in _SHAPES if m in planned]
    else:
        return ForwardMode(value)
    raise BatchError(why, field="idle_as", expected=expected, actual=getattr(value, "value", value))


def _check_idle(mode: ForwardMode, bs: int) -> None:
    """An idle batch has no request, and only an idle batch has none."""
    if mode is ForwardMode.IDLE and bs:
        raise BatchError(
            "an idle batch has no requests", field="seq_lens_cpu", expected=0, actual=bs
        )
    if bs == 0 and mode is not ForwardMode.IDLE:
        raise BatchError(
            "empty batch (a rank with no work sends mode idle)",
            field="seq_lens_cpu",
            expected=">= 1 request",
            actual=0,
        )


def _check_device_lens(
    batch: ForwardBatch,
    seq: torch.Tensor,
    bs: int,
    on_device: tuple[torch.device, ...],
    device_reads: bool,
) -> None:
    """The engine's device copies of the lengths: each with its host copy, on the planner's
    device, and (``device_reads`` only: a sync) equal to it."""
    for name, host in (("seq_lens", seq), ("extend_lens", batch.extend_lens_cpu)):
        dev = getattr(batch, name)
        if dev is None:
            continue
        if host is None:
            raise BatchError(f"device {name} without its host copy", field=f"{name}_cpu")
        _check_tensor(name, dev, _INT32_ONLY, 1, on_device, bs)
        if device_reads and not torch.equal(dev.cpu(), host):
            raise BatchError(f"device {name} differ from {name}_cpu", field=name)


def _check_extend_lens(batch: ForwardBatch, mode: ForwardMode, bs: int, max_tokens: int) -> int:
    """The query tokens of the batch: extend lengths are required for ragged modes only."""
    lens = batch.extend_lens_cpu
    if lens is None:
        if mode.ragged or mode.padded_rows:
            raise BatchError(
                f"a {mode.value} batch says how many tokens each request adds",
                field="extend_lens_cpu",
                expected="int32 [bs]",
                actual=None,
            )
        tokens = bs * batch.next_n
    elif mode.stepped:
        raise BatchError(
            "a draft-decode batch adds exactly k tokens per request: leave extend_lens_cpu out",
            field="extend_lens_cpu",
            expected="None",
            actual="a tensor",
        )
    else:
        _check_tensor("extend_lens_cpu", lens, _INT32_ONLY, 1, (_CPU,), bs)
        least = int(lens.min()) if bs else 1
        tokens = int(lens.sum(dtype=torch.int64))
        if least < 1:  # the token layout itself is undefined: not a range
            raise BatchError(
                "every request adds at least one token",
                field="extend_lens_cpu",
                expected=">= 1",
                actual=least,
            )
    if mode.ragged and tokens > max_tokens:
        raise BatchError(
            "more query tokens than max_tokens",
            field="extend_lens_cpu",
            expected=f"<= {max_tokens} tokens",
            actual=tokens,
        )
    return tokens


def check_size(name: str, value: object, lo: int, hi: int, what: str) -> int:
    """A request count argument (``bs``, ``pad_to``): an integer in ``[lo, hi]`` (numpy's
    included), as a Python int; a float or a bool is refused."""
    try:
        size = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        size = None
    if size is None or not lo <= size <= hi:
        shown = repr(value) if isinstance(value, str) else value
        raise BatchError(what, field=name, expected=f"an int in [{lo}, {hi}]", actual=shown)
    return size


def check_replay_size(bs: object, real: int, max_batch: int) -> int:
    """``replay(batch, bs)``: a captured size in range (the batch's own, at least one, by
    default) that holds the batch's ``real`` requests; the size as a Python int."""
    bs = check_size(
        "bs", max(real, 1) if bs is None else bs, 1, max_batch, "replay size out of range"
    )
    if real > bs:
        raise BatchError(
            "batch larger than the replayed size", field="bs", expected=f"<= {bs}", actual=real
        )
    return bs


def check_pad_to(
    pad_to: object, pad_tokens: object, bs: int, max_batch: int, max_tokens: int, mode: ForwardMode
) -> tuple[int | None, int | None]:
    """``plan(batch, pad_to=n, pad_tokens=t)``: a captured bucket's shape (a ragged one names
    both, a uniform one only ``pad_to``, which holds the batch); both as Python ints."""
    if pad_tokens is not None and not mode.ragged:
        raise BatchError(
            f"a {mode.value} batch pads requests only: leave pad_tokens out",
            field="pad_tokens",
            expected=None,
            actual=pad_tokens,
        )
    if pad_to is None:
        if pad_tokens is not None:
            raise BatchError("pad_tokens comes with pad_to", field="pad_to", actual=None)
        return None, None
    pad_to = check_size("pad_to", pad_to, bs, max_batch, "pad_to out of range")
    if not mode.ragged:
        return pad_to, None
    if pad_tokens is None:
        raise BatchError(
            "a ragged batch padded to a bucket names its token bucket too",
            field="pad_tokens",
            expected=f"an int in [1, {max_tokens}]",
            actual=None,
        )
    return pad_to, check_size("pad_tokens", pad_tokens, 1, max_tokens, "out of range")


def check_capture(
    mode: ForwardMode, bs: object, tokens: object, max_batch: int, max_tokens: int
) -> tuple[int, int | None]:
    """``capture(bs, mode, tokens=)``: a capturable mode (idle replays its shape's graphs), a
    size in range, and for a ragged mode its token bucket in ``[1, max_tokens]`` (a bucket
    smaller than ``bs`` holds batches of as many requests as tokens at most), else none;
    both as Python ints."""
    if mode is ForwardMode.IDLE:
        raise BatchError(
            "idle batches replay the graphs of their shape (idle_as): capture that mode",
            field="mode",
            expected=[m.value for m in ForwardMode if m is not ForwardMode.IDLE],
            actual=mode.value,
        )
    bs = check_size("bs", bs, 1, max_batch, "capture size out of range")
    if not mode.ragged:
        if tokens is not None:
            raise BatchError(
                f"a {mode.value} capture's tokens follow from bs: leave tokens out",
                field="tokens",
                expected=None,
                actual=tokens,
            )
        return bs, None
    if tokens is None:
        raise BatchError(
            f"a {mode.value} capture names its token bucket",
            field="tokens",
            expected=f"an int in [1, {max_tokens}]",
            actual=None,
        )
    return bs, check_size("tokens", tokens, 1, max_tokens, "token bucket out of range")


def check_bucket(real: int, tokens: int, name: str) -> None:
    """A ragged batch of ``real`` query tokens fits a bucket of ``tokens`` (padding requests
    add none; the bound on its KV is checked on the device). ``name``: the argument that
    named the token bucket."""
    if real > tokens:
        raise BatchError(
            "more query tokens than the token bucket",
            field=name,
            expected=f">= {real}",
            actual=tokens,
        )


def check_host_lengths(batch: ForwardBatch, ranges: Mapping[str, tuple[int, int]]) -> None:
    """The host lengths a host op reads at replay (FlashInfer's ``plan``), in range: the
    device check refuses the batch inside the graph, after the host op has run, so what the
    op computes from must be sound before it runs."""
    for name, source in (("seq_lens_cpu", "seq_lens"), ("extend_lens_cpu", "extend_lens")):
        values = getattr(batch, name)
        if values is None or not values.numel():
            continue
        low, high = ranges[source]
        least, most = int(values.min()), int(values.max())
        if least < low or most > high:
            raise BatchError(
                "value out of range",
                field=name,
                expected=f"[{low}, {high}]",
                actual=least if least < low else most,
            )


def validate_written(batch: ForwardBatch, next_n: Mapping[ForwardMode, int]) -> tuple[int, int]:
    """A batch that is a staging slot's own views (``StepInputs.batch``: the engine wrote the
    step there): its structure holds by construction (int32 host views, lengths from the
    slot's counts, each count within the slot). What is left to check: that its tensors are
    still the slot's, its ``next_n``, and a uniform batch's token count. Its requests and
    query tokens."""
    inputs = batch.inputs
    reqs, tokens = inputs.reqs, inputs.tokens
    for name, source, count in (
        ("seq_lens_cpu", "seq_lens", reqs),
        ("req_pool_indices", "req_pool_indices", reqs),
        ("out_cache_loc", "out_cache_loc", tokens),
    ):
        tensor = getattr(batch, name)
        if tensor.data_ptr() != inputs.addresses[source] or tensor.shape[0] != count:
            raise BatchError(
                "a batch marked as written into a staging slot whose tensors are not the slot's",
                field=name,
                expected="StepInputs.batch() of the slot",
                actual="another tensor",
            )
    mode = inputs.mode
    want = next_n.get(mode, 1)
    if batch.next_n != want:
        raise BatchError(
            f"next_n does not match the planner for mode {mode.value} (its tokens per request)",
            field="next_n",
            expected=want,
            actual=batch.next_n,
        )
    _check_idle(mode, reqs)
    if not (mode.ragged or mode.padded_rows) and tokens != reqs * want:
        raise BatchError(
            f"a {mode.value} step adds next_n tokens per request",
            field="tokens",
            expected=reqs * want,
            actual=tokens,
        )
    return reqs, tokens


def lengths_max_sum(lengths: torch.Tensor, empty_max: int) -> tuple[int, int]:
    """The longest and the total of a batch's host KV lengths, which size an eager plan;
    ``(empty_max, 1)`` for an empty batch."""
    if not lengths.numel():
        return empty_max, 1
    return int(lengths.max()), int(lengths.sum())
