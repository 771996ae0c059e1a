"""Before a run allocates: the memory its config needs, against what the device has.

``decode`` used to find out by allocating: ``dsv32-small`` on a 24 GB CPU ran 48 s and was
killed by the kernel (exit 137, no message). Now :func:`check_memory` adds up what the run
will hold, term by term, from the config's dimensions alone (nothing is allocated), and
refuses a config that cannot fit in one line naming the largest term and the setting that
shrinks it. An allocation that fails anyway (the estimate leaves out what is small or hard
to know: the interpreter, kernels' workspaces, fragmentation) becomes one line too:
:func:`allocation_errors`.

The terms, and where each comes from:

* **weights**: the model built on the ``meta`` device (shapes and dtypes, no storage), its
  parameters and buffers summed; the MTP draft's layer too when the run drafts with it.
  The CPU builds them in place (``to_empty``, then in-place random init): no transient. On
  CUDA the fused input projections are concatenated copies (``FusedWeights``): the largest
  group is held twice for a moment. A weights file is read one tensor at a time: the
  largest tensor is held twice.
* **KV cache**: ``loop.kv_pages``, else the pages ``model_setup.kv_pages`` sizes: on the CPU
  ``max_batch`` requests of ``max_context``; on a GPU the least it accepts (one request of
  ``max_context``), since it sizes the cache from the memory left. Each page costs
  ``kv_cache.cache_bytes`` in every layer (and the MTP layer's).
* **request map**: ``req_to_token``, ``max_batch + 1`` rows of ``max_context`` int32.
* **GPU**: ``loop.graph_reserve_mb`` for graph pools and activations, and the share of the
  memory left after the weights that ``loop.kv_memory_fraction`` keeps back, as
  ``kv_pages`` reserves them; together exactly the rule by which ``kv_pages`` refuses.
* **CPU forward**: the largest transient of one forward, the torch sparse MLA reference
  (``backends.nsa.attention.sparse_mla_decode``): each row's ``index_topk`` KV slots
  gathered in the model dtype and widened to float64, then three float64 logit tensors
  ``[heads, topk]`` per row beside the widened slots. Measured against the real op in
  ``tests/serving/test_memory_fit.py`` (within 15%). Every other op of the forward holds
  less, and the GPU's kernels read the cache in place.

"What the device has": on CUDA ``torch.cuda.mem_get_info``'s free bytes; on the CPU the
least of ``MemAvailable`` (``/proc/meminfo``), the cgroup's ``memory.max`` less its
``memory.current``, and ``RLIMIT_AS`` less the address space this process already maps
(``/proc/self/statm``). Where none of them can be read (off Linux, no limit) the check
says nothing and the run goes on.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ParamSpec, TypeVar

import torch

from dsv32_engine.models.config import DSV32Config
from dsv32_engine.models.kv_cache import pages_for, request_map_bytes
from dsv32_engine.models.model import DSV32Model
from dsv32_engine.models.mtp import MTPDraft
from dsv32_engine.serving.model_setup import (
    kv_page_bytes,
    max_kv_pages,
    model_config,
    model_dtype,
    resolve_device,
)
from dsv32_engine.serving.run_config import RunConfig
from planner.errors import ConfigError

try:
    import resource
except ImportError:  # Windows has no resource module: no address-space limit to read
    resource = None  # type: ignore[assignment]

GIB = 1 << 30
MLA_LOGIT_COPIES = 3
"""Float64 ``[heads, topk]`` tensors per row the CPU's sparse MLA holds at once beside the
widened KV (logits, their masked and exponentiated copies), as measured."""


class MemoryFitError(ConfigError):
    """The device cannot hold what the run would allocate (refused before it does), or an
    allocation failed anyway."""


@dataclass(frozen=True)
class Term:
    """One thing the run holds: its bytes, the setting that shrinks it and how."""

    name: str
    nbytes: int
    field: str
    advice: str
    actual: object = None
    """``field``'s value now."""
    unit: int = 0
    """Bytes per unit of ``field`` where the term grows with it (a page, a row), else 0."""
    units_besides: int = 0
    """Units the term holds that ``field`` does not set (a chunk's decode rows)."""
    least: int = 1
    """The smallest value ``field`` may take."""

    def fitting(self, room: int) -> int | None:
        """The largest value of ``field`` that fits in ``room`` bytes (None: none does, or
        the term does not grow with ``field``)."""
        if not self.unit:
            return None
        value = room // self.unit - self.units_besides
        return value if value >= self.least else None


@dataclass(frozen=True)
class MemoryNeed:
    """What a run needs on one device, term by term (``ranks`` processes share it)."""

    device: str
    terms: tuple[Term, ...]
    ranks: int = 1

    @property
    def total(self) -> int:
        return sum(t.nbytes for t in self.terms) * self.ranks

    @property
    def largest(self) -> Term:
        return max(self.terms, key=lambda t: t.nbytes)

    def term(self, name: str) -> Term:
        return next(t for t in self.terms if t.name == name)


@dataclass(frozen=True)
class Available:
    """Bytes the device can still give the run, and which figure said so."""

    nbytes: int
    source: str


def size(nbytes: float) -> str:
    """``23.8 GiB``, ``612 MiB``: one decimal at GiB scale, whole MiB below."""
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB else f"{nbytes / (1 << 20):.0f} MiB"


# ---- the estimate -----------------------------------------------------------------------------


def weight_sizes(model_cfg: DSV32Config, dtype: torch.dtype, *, mtp: bool = False) -> list[int]:
    """Bytes of each of the model's parameters and buffers (and the MTP draft layer's), from
    the model built on ``meta``: the very shapes and dtypes a real build allocates."""
    model = DSV32Model(model_cfg, device="meta", dtype=dtype)
    modules: list[torch.nn.Module] = [model]
    if mtp:
        modules.append(MTPDraft(model))
    return [t.numel() * t.element_size() for m in modules for t in (*m.parameters(), *m.buffers())]


def weight_bytes(model_cfg: DSV32Config, dtype: torch.dtype, *, mtp: bool = False) -> int:
    """Bytes of the model's weights: :func:`weight_sizes` summed."""
    return sum(weight_sizes(model_cfg, dtype, mtp=mtp))


def _largest_fused_group(model_cfg: DSV32Config, dtype: torch.dtype) -> int:
    """The largest ``FusedWeights`` concatenation a CUDA build makes: the MLA input
    projections, or a dense MLP's ``w1`` and ``w3`` (``MLA/MLP.fuse_projections``)."""
    d = model_cfg.hidden_size
    rows = model_cfg.q_lora_rank + model_cfg.kv_cache_dim + model_cfg.index_head_dim
    widths = [model_cfg.intermediate_size if model_cfg.first_k_dense_replace else 0]
    if model_cfg.moe_stand_in_dim is not None:
        widths.append(model_cfg.moe_stand_in_dim)
    elif model_cfg.n_shared_experts:
        widths.append(model_cfg.n_shared_experts * model_cfg.moe_intermediate_size)
    return max(rows, 2 * max(widths)) * d * dtype.itemsize


def forward_rows(config: RunConfig) -> int:
    """Query rows of the widest forward the run makes: a step's token budget (a prompt chunk,
    or mixing, decode rows and the chunks they leave room for), or ``max_batch`` requests of
    ``next_n`` rows."""
    p = config.planner
    return max(config.loop.chunk_tokens, p.max_batch * config.speculative.next_n)


def cpu_forward_row_bytes(model_cfg: DSV32Config, dtype: torch.dtype) -> int:
    """Peak bytes one row holds in the CPU's sparse MLA (see the module docstring)."""
    k = model_cfg.index_topk
    widen = k * model_cfg.kv_cache_dim * (dtype.itemsize + 8)
    logits = k * 8 * (model_cfg.kv_cache_dim + MLA_LOGIT_COPIES * model_cfg.num_attention_heads)
    return max(widen, logits)


def estimate(
    config: RunConfig, device: torch.device, *, ranks: int = 1, free: int | None = None
) -> MemoryNeed:
    """What ``config`` holds on ``device`` (per rank; ``ranks`` of them share it). On a GPU
    whose KV cache is sized from memory, ``free`` (the GPU's free bytes now) gives the share
    ``loop.kv_memory_fraction`` keeps back of what the weights leave."""
    model_cfg = model_config(config.model)
    dtype = model_dtype(config)
    loop, p = config.loop, config.planner
    mtp = config.speculative.draft == "mtp"
    cuda = device.type == "cuda"
    smaller = "use a smaller model.preset or fewer model.overrides.num_hidden_layers"
    if config.model.dtype == "float32":
        smaller += " (model.dtype bfloat16 halves it)"
    sizes = weight_sizes(model_cfg, dtype, mtp=mtp)  # one meta build serves both terms
    terms = [
        Term(
            "weights",
            sum(sizes),
            "model.preset",
            f"{smaller}, or a device with more memory",
            actual=config.model.preset,
        )
    ]
    per_page = kv_page_bytes(config, model_cfg, dtype)
    least = pages_for(p.max_context, model_cfg.page_size) + 1
    if loop.kv_pages is not None:
        pages = loop.kv_pages
    else:
        pages = least if cuda else max_kv_pages(config, model_cfg)
    kv_field = "loop.kv_pages" if loop.kv_pages is not None or not cuda else "planner.max_context"
    terms.append(
        Term(
            "KV cache",
            pages * per_page,
            kv_field,
            f"{pages} pages of {size(per_page)}; set loop.kv_pages lower (one request of "
            f"max_context needs {least}), or lower planner.max_batch or planner.max_context",
            actual=pages,
            unit=per_page if kv_field == "loop.kv_pages" else 0,
            least=least,
        )
    )
    terms.append(
        Term(
            "request map",
            request_map_bytes(p.max_batch + 1, p.max_context),
            "planner.max_context",
            "lower planner.max_context or planner.max_batch",
            actual=p.max_context,
        )
    )
    if config.model.weights:
        terms.append(
            Term(
                "loading weights",
                max(sizes),
                "model.weights",
                "the largest tensor is held twice while it is read: use a smaller model",
            )
        )
    if cuda:
        terms.append(
            Term(
                "fusing projections",
                _largest_fused_group(model_cfg, dtype),
                "model.preset",
                f"the largest fused projection is copied once: {smaller}",
            )
        )
        terms.append(
            Term(
                "graph reserve",
                loop.graph_reserve_mb << 20,
                "loop.graph_reserve_mb",
                "kept for graph pools and activations: lower loop.graph_reserve_mb if they "
                "need less",
                actual=loop.graph_reserve_mb,
            )
        )
        if loop.kv_pages is None and free is not None:
            left = max(0, free - terms[0].nbytes)
            terms.append(
                Term(
                    "kept back by kv_memory_fraction",
                    int(left * (1 - loop.kv_memory_fraction)),
                    "loop.kv_memory_fraction",
                    "raise loop.kv_memory_fraction (the KV cache may take that share of the "
                    "memory the weights leave)",
                    actual=loop.kv_memory_fraction,
                )
            )
    else:
        per_row = cpu_forward_row_bytes(model_cfg, dtype)
        rows = forward_rows(config)
        chunked = rows > p.max_batch * config.speculative.next_n  # a chunk is the widest
        terms.append(
            Term(
                "forward activations",
                rows * per_row,
                "loop.chunk_tokens",
                f"the CPU's float64 sparse attention holds {size(per_row)} per row of the widest "
                f"forward ({rows} rows: loop.chunk_tokens, with planner.max_batch when decodes "
                "join it); lower loop.chunk_tokens, or run on cuda",
                actual=loop.chunk_tokens,
                unit=per_row if chunked else 0,
                units_besides=rows - loop.chunk_tokens,
            )
        )
    return MemoryNeed(str(device), tuple(terms), ranks)


# ---- what the device has ----------------------------------------------------------------------


def _meminfo_available(path: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_available(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((root / "memory.current").read_text()))
    except (OSError, ValueError):
        return None


def _address_space_available() -> tuple[int, int] | None:
    """``(RLIMIT_AS, bytes this process maps now)``, when a limit is set and readable."""
    if resource is None:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return soft, pages * os.sysconf("SC_PAGE_SIZE")


def cpu_available() -> Available | None:
    """The least of what the host, the cgroup and this process's address-space limit leave
    (None where none can be read)."""
    figures: list[Available] = []
    host = _meminfo_available()
    if host is not None:
        figures.append(Available(host, "MemAvailable"))
    cgroup = _cgroup_available()
    if cgroup is not None:
        figures.append(Available(cgroup, "the cgroup's memory.max less memory.current"))
    space = _address_space_available()
    if space is not None:
        limit, mapped = space
        figures.append(
            Available(max(0, limit - mapped), f"RLIMIT_AS {size(limit)} less {size(mapped)} mapped")
        )
    return min(figures, key=lambda a: a.nbytes) if figures else None


def device_available(device: torch.device) -> Available | None:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return Available(free, "free on the GPU")
    if device.type == "cpu":
        return cpu_available()
    return None


# ---- the check --------------------------------------------------------------------------------


def _ranks_here(config: RunConfig, device: torch.device) -> int:
    """Processes of this run that share ``device``'s memory: every rank on the CPU (those of
    this host under torchrun), one per GPU."""
    if device.type != "cpu":
        return 1
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(local) if local.isdigit() and int(local) > 0 else config.distributed.world


def check_memory(config: RunConfig, *, available: Available | None = None) -> MemoryNeed | None:
    """Refuse ``config`` if what it holds cannot fit in what the device has; the estimate,
    or None where it is not made (the device's free memory unknown, or a GPU run of several
    spawned ranks: measuring a GPU here would hold a CUDA context on it for the whole run).

    ``available`` replaces the device's own figure (tests)."""
    device = resolve_device(config.device)
    if device.type == "cuda" and device.index is None:
        local = os.environ.get("LOCAL_RANK", "")
        if config.distributed.world > 1 and not local.isdigit():
            return None
        device = torch.device(
            "cuda", int(local) if local.isdigit() else torch.cuda.current_device()
        )
    if available is None:
        available = device_available(device)
    free = None if available is None else available.nbytes
    need = estimate(config, device, ranks=_ranks_here(config, device), free=free)
    if available is None or need.total <= available.nbytes:
        return need
    big = need.largest
    room = available.nbytes // need.ranks - (need.total // need.ranks - big.nbytes)
    fits = big.fitting(room)
    terms = ", ".join(
        f"{t.name} {size(t.nbytes)}" for t in sorted(need.terms, key=lambda t: -t.nbytes)
    )
    ranks = f" for each of {need.ranks} ranks" if need.ranks > 1 else ""
    raise MemoryFitError(
        f"the config needs {size(need.total)} ({terms}{ranks}) but the {device} has "
        f"{size(available.nbytes)} available ({available.source}); the largest term is "
        f"{big.name}: {big.advice}",
        field=big.field,
        expected=None if fits is None else f"<= {fits}",
        actual=big.actual,
    )


# ---- an allocation that fails anyway ----------------------------------------------------------

_OOM_MESSAGES = ("can't allocate memory", "not enough memory", "out of memory")


def allocation_failure(exc: BaseException) -> str | None:
    """What failed, if ``exc`` is a failed allocation (Python's, the CPU's or CUDA's); the
    first line of torch's message, else None."""
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)) or (
        isinstance(exc, RuntimeError) and any(m in str(exc) for m in _OOM_MESSAGES)
    ):
        text = str(exc).strip().splitlines()
        return text[0] if text else type(exc).__name__
    return None


P = ParamSpec("P")
R = TypeVar("R")


def allocation_errors(run: Callable[P, R]) -> Callable[P, R]:
    """``run`` with a failed allocation (building the engine or serving) raised as one
    :class:`MemoryFitError` instead of a traceback; anything else passes through."""

    @functools.wraps(run)
    def guarded(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return run(*args, **kwargs)
        except (MemoryError, RuntimeError) as exc:
            what = allocation_failure(exc)
            if what is None:
                raise
            raise MemoryFitError(
                f"an allocation failed although the memory check passed ({what}); lower "
                "loop.chunk_tokens, planner.max_batch or planner.max_context, or use a "
                "device with more free memory",
                field="device",
            ) from None

    return guarded
