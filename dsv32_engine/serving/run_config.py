"""The decode run's YAML config: model, planner, graphs and request loop, validated once.

Every section is a frozen pydantic model with ``extra="forbid"``, so a typo
in a YAML key is an error naming the key, not a silently ignored setting.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from backends.deepgemm import BLOCK_KV
from dsv32_engine import SHIPPED_CONFIGS
from graphs.sizes import check_ragged_cap
from planner.errors import ConfigError

MAX_CONTEXT = 1 << 20
"""The longest ``planner.max_context``: the request map alone is ``max_batch + 1`` rows of it."""
MAX_REQUESTS = 100_000
"""The most ``loop.requests`` (see ``LoopSection.requests``)."""
MAX_PROMPT_TOKENS = 1 << 24
"""The most prompt tokens a workload may hold at worst: ``requests x prompt_len[1]``."""
MAX_STEPS = 1_000_000
"""The most ``loop.max_steps`` (see ``LoopSection.max_steps``)."""


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelSection(_Section):
    """Which DeepSeek-V3.2 to build: a preset or a ``config.json``, plus overrides."""

    preset: str = Field(
        "tiny", description="tiny | small | shapes | full, or a path to a config.json"
    )
    overrides: dict[str, Any] = Field(
        default_factory=dict, description="DSV32Config fields to change"
    )
    dtype: Literal["float32", "bfloat16"] = "float32"
    seed: int = Field(0, ge=0)
    weights: str | None = Field(None, description="safetensors file to load instead of random init")


class PlannerSection(_Section):
    """Limits and provider choices of the planner."""

    max_batch: int = Field(16, ge=1, le=4096)
    max_context: int = Field(256, ge=64, le=MAX_CONTEXT)
    next_n: int = Field(
        1, description="kept so older configs load: verify rows are speculative.draft_tokens"
    )
    num_sms: int | None = Field(None, ge=1, description="None: the GPU's SM count (132 on the CPU)")
    providers: dict[str, str] = Field(
        default_factory=dict, description="op or backend.field -> provider"
    )
    debug: bool = False
    ops_in_graph: bool = True
    staging_in_graph: bool | Literal["auto"] = Field(
        "auto",
        description="the captured graphs pull each replay's staged inputs out of pinned memory "
        "themselves, so a replay makes no CUDA call; auto: whenever ops_in_graph",
    )
    schedule_layout: Literal["0.1.0", "new"] = "0.1.0"
    ragged_kv_tokens: int | None = Field(
        None,
        ge=1,
        description="the most KV (sum of lengths) a prompt-chunk or mixed batch may hold and "
        "still replay a ragged graph, whose flat KV buffers are this long; None: what the KV "
        "cache holds, at most max_batch x max_context (no batch holds more)",
    )
    mla_kernel: Literal["auto", "triton", "torch", "flashinfer"] = Field(
        "auto",
        description="sparse MLA: auto (the Triton kernel on CUDA), triton, torch, or flashinfer "
        "(FlashInfer's MLA kernel planned once per batch for decode and verify; extend keeps auto)",
    )
    batch_invariant: bool = Field(
        False,
        description="every row of a forward computes the same bits whatever else is in its "
        "batch (docs/batch_invariance.md): fixed-tile GEMMs, a sparse MLA split schedule "
        "fixed per row, verify rows expanded like decode rows; off: the fastest kernels",
    )


class GraphsSection(_Section):
    """CUDA graphs (emulated on the CPU)."""

    enabled: bool | Literal["auto"] = "auto"
    sizes: list[int] | None = None
    ragged: bool | Literal["auto"] = Field(
        "auto",
        description="capture extend and mixed batches too, in token buckets; auto: on where "
        "graphs run on CUDA (an H100 ran arriving requests 2.85x faster with mixing, issue "
        "37), off on the CPU, where an emulated replay re-runs the padded forward (slower "
        "than eager: 355 against 550 tokens/s for the tiny demo)",
    )
    token_sizes: list[int] | None = Field(
        None, description="token buckets of ragged graphs; None: 16, 32, 64, ... max_tokens"
    )
    ragged_max_tokens: int | None = Field(
        None,
        gt=0,
        description="the largest token bucket of the default ladder; a step of more tokens "
        "runs eagerly, by design (a ragged step, not a fallback). None: the step budget "
        "(loop.chunk_tokens). Set it where such steps are GPU-bound and eager costs what a "
        "replay does (dsv32-shapes on an H100: a mixed step replayed 1.59x faster than eager "
        "at 512 tokens, 1.04x at 768, 1.00x at 2,048): each bucket costs capture time",
    )


class LoopSection(_Section):
    """The continuous-batching request loop.

    Its sizes are bounded by what a run can finish: the workload is made up front in host
    memory (``requests.make_workload``: measured ~0.6 us and 25-40 bytes a prompt token on a
    2-core CPU), and the default run's 32 requests took 1.7 s to serve there (~500 tokens/s).
    """

    requests: int = Field(
        32,
        ge=1,
        le=MAX_REQUESTS,
        description=f"requests in the workload, at most {MAX_REQUESTS:,}: at the tiny CPU "
        "model's ~500 tokens/s that many of its requests take ~3 h to serve, and making them "
        "~5 s (10x that took 26 s and 1.1 GB before the first step, and promised 24 h)",
    )
    arrival_rate: float = Field(3.0, gt=0, description="mean new requests per step (Poisson)")
    prompt_len: tuple[int, int] = Field(
        (8, 40),
        description="[lo, hi] prompt tokens, drawn uniformly; hi <= planner.max_context, and "
        f"requests x hi <= {MAX_PROMPT_TOKENS:,} (the prompts are made up front: 0.4-0.6 GB "
        "and ~10 s of set-up at that bound)",
    )
    max_new_tokens: tuple[int, int] = Field(
        (8, 40), description="[lo, hi] tokens each request generates; hi <= planner.max_context"
    )
    seed: int = Field(0, ge=0)
    max_steps: int = Field(
        100_000,
        ge=1,
        le=MAX_STEPS,
        description=f"loop steps before the run stops, at most {MAX_STEPS:,}: a decode step of "
        "the tiny CPU model takes ~20 ms (2 cores), so that many take ~5.5 h",
    )
    kv_pages: int | None = Field(
        None,
        ge=2,
        description="KV cache pages; None: sized from memory on a GPU (kv_memory_fraction), "
        "enough for max_batch requests of max_context on the CPU",
    )
    kv_memory_fraction: float = Field(
        0.85,
        gt=0,
        le=1,
        description="share of the GPU memory free after the weights that KV and index caches "
        "may take (SGLang's mem_fraction_static)",
    )
    graph_reserve_mb: int = Field(
        4096, ge=0, description="GPU memory kept back for CUDA-graph pools and activations"
    )
    chunk_tokens: int = Field(
        256,
        ge=1,
        le=1 << 20,
        description="a step's token budget: the prompt tokens it prefills (chunked prefill) "
        "and, mixing (loop.mixed), its decode rows too (speculating, speculative.draft_tokens "
        "verify rows per request), which take their share first",
    )
    idle_steps: bool = Field(
        False,
        description="step with an idle batch when nothing runs, as a data-parallel rank must "
        "(it keeps its peers' collectives in step); a single rank just waits",
    )
    mixed: bool | Literal["auto"] = Field(
        "auto",
        description="run decode requests inside the step's extend batch (one mixed forward) "
        "instead of a separate decode graph step; speculating, their verify rows "
        "(speculative.draft_tokens each) join it the same way; auto: where graphs run on CUDA",
    )
    overlap: bool | Literal["auto"] = Field(
        "auto",
        description="run one step ahead: build and launch step N+1 while step N runs, and "
        "read step N's tokens after (decode rows take their token on the device); auto: on "
        "CUDA. Speculative decoding keeps the synchronous loop (each round's lengths follow "
        "from the accepted drafts the host reads)",
    )

    @field_validator("prompt_len", "max_new_tokens")
    @classmethod
    def _range(cls, value: tuple[int, int]) -> tuple[int, int]:
        lo, hi = value
        if not 1 <= lo <= hi:
            raise ValueError(f"must be [lo, hi] with 1 <= lo <= hi, got {[lo, hi]}")
        if hi > MAX_CONTEXT:
            raise ValueError(
                f"hi must be <= {MAX_CONTEXT:,} (planner.max_context's bound), got {hi}"
            )
        return value


class SpeculativeSection(_Section):
    """Speculative decoding: which draft proposes tokens, and how many the target verifies.

    Each round the target verifies ``draft_tokens`` rows per request (its last
    token and ``steps`` drafts: a top-1 chain, so ``steps = draft_tokens - 1``);
    greedy acceptance keeps the longest prefix of drafts the target agrees
    with, plus the target's own next token. ``mtp``: DeepSeek-V3.2's MTP layer
    (draft extend over the accepted tokens, then ``steps - 1`` draft-decode
    steps); ``ngram``: prompt lookup over the request's own tokens, no model.
    """

    draft: Literal["none", "ngram", "mtp"] = Field("none", description="none turns it off")
    draft_tokens: int = Field(4, ge=2, le=8, description="rows per request in target verify")
    steps: int | None = Field(None, ge=1, le=7, description="drafts per round (draft_tokens - 1)")
    ngram_max: int = Field(4, ge=1, le=16, description="longest suffix the n-gram draft matches")
    ngram_min: int = Field(1, ge=1, le=16, description="shortest suffix it falls back to")
    mtp_seed: int = Field(1, ge=0, description="seed of the MTP layer's random weights")
    compare_plain: bool = Field(
        False, description="also serve the workload without speculation and report both"
    )

    @property
    def enabled(self) -> bool:
        return self.draft != "none"

    @property
    def next_n(self) -> int:
        """Tokens per request in target verify (1 when speculation is off)."""
        return self.draft_tokens if self.enabled else 1

    @property
    def decode_steps(self) -> int:
        """Draft-decode steps per round: the MTP draft's first token comes from draft extend."""
        return self.draft_tokens - 2 if self.draft == "mtp" else 0

    @property
    def device_drafts(self) -> int:
        """Drafts per request kept on the device for the next verify: the MTP draft's
        ``draft_tokens - 1`` (``serving.token_ids``); an n-gram draft's stay on the host."""
        return self.draft_tokens - 1 if self.draft == "mtp" else 0


class DistributedSection(_Section):
    """Several ranks through torch.distributed (``docs/distributed.md``): ``tp x dp_attention``.

    ``tp``: the ranks of a replica serve the same requests, each with its own planner and
    its share of the attention heads (``wo`` row-parallel, all-reduced; the rest
    replicated), and prove every forward that they planned alike.
    ``dp_attention``: the workload's requests are split over the replicas, each attends
    over its own, the FFN runs over every replica's rows, and all agree on each step's
    forwards and graph sizes (an idle replica replays IDLE batches of its peers' shape).
    Both compose, with speculative decoding too: rank ``r`` is TP rank ``r % tp`` of
    replica ``r // tp``.
    """

    tp: int = Field(
        1, ge=1, le=64, description="tensor-parallel ranks (heads split; same workload on each)"
    )
    dp_attention: int = Field(
        1, ge=1, le=64, description="data-parallel attention ranks (requests split over them)"
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="auto: nccl on CUDA devices, gloo on the CPU"
    )
    timeout_s: float = Field(
        300.0, gt=0, le=86400, description="collective timeout: a stalled peer is an error"
    )
    digests: bool | None = Field(
        None, description="all-gather plan digests every step (None: when planner.debug)"
    )
    dp_split: Literal["round_robin", "blocks"] = Field(
        "round_robin",
        description="how requests go to data-parallel ranks: request i to rank i % world, or "
        "contiguous blocks in arrival order (ranks then idle for stretches)",
    )

    @property
    def world(self) -> int:
        return self.tp * self.dp_attention


class RunConfig(_Section):
    """A whole decode run."""

    device: str = "cpu"
    model: ModelSection = ModelSection()
    planner: PlannerSection = PlannerSection()
    graphs: GraphsSection = GraphsSection()
    loop: LoopSection = LoopSection()
    speculative: SpeculativeSection = SpeculativeSection()
    distributed: DistributedSection = DistributedSection()

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        try:
            torch.device(value)
        except (RuntimeError, TypeError):
            raise ValueError(f"not a torch device: {value!r} (cpu, cuda, cuda:1)") from None
        return value

    @property
    def graphs_on(self) -> bool:
        """Whether forwards replay captured graphs (``graphs.enabled``; auto: always, emulated
        on the CPU)."""
        return self.graphs.enabled is not False

    @property
    def ragged_graphs(self) -> bool:
        """Whether extend and mixed batches replay token-bucket graphs (``graphs.ragged``
        resolved: auto is on where graphs run on CUDA)."""
        if self.graphs.ragged == "auto":
            return self._graphs_on_cuda
        return bool(self.graphs.ragged)

    @property
    def mixes(self) -> bool:
        """Whether decode (or, speculating, verify) requests join the step's prompt chunks
        (``loop.mixed`` resolved: auto is on where graphs run on CUDA)."""
        if self.loop.mixed == "auto":
            return self._graphs_on_cuda
        return bool(self.loop.mixed)

    @property
    def _graphs_on_cuda(self) -> bool:
        return self.graphs_on and torch.device(self.device).type == "cuda"

    def check_fits(self) -> None:
        """Cross-section limits, reported on the field to change."""
        spec = self.speculative
        if self.planner.next_n != 1:
            raise ConfigError(
                "tokens per verify are set by speculative.draft_tokens (with speculative.draft)",
                field="planner.next_n",
                expected=1,
                actual=self.planner.next_n,
            )
        if spec.steps is not None and spec.steps != spec.draft_tokens - 1:
            raise ConfigError(
                "a top-1 draft chain proposes draft_tokens - 1 tokens per round",
                field="speculative.steps",
                expected=spec.draft_tokens - 1,
                actual=spec.steps,
            )
        if spec.ngram_min > spec.ngram_max:
            raise ConfigError(
                "the shortest n-gram is longer than the longest",
                field="speculative.ngram_min",
                expected=f"<= {spec.ngram_max} (speculative.ngram_max)",
                actual=spec.ngram_min,
            )
        rows = spec.next_n  # each decoding request's rows in a mixed step
        least = (self.planner.max_batch - 1) * rows + 1
        if self.mixes and self.loop.chunk_tokens < least:
            per = (
                f"{rows} rows (speculative.draft_tokens) of each decoding request"
                if rows > 1
                else "one row of each decoding request"
            )
            raise ConfigError(
                f"a mixed step's token budget holds {per} first and prompt chunks in what "
                "they leave: below (planner.max_batch - 1) x rows + 1, a prompt beside a "
                "full batch of decoding requests would get nothing",
                field="loop.chunk_tokens",
                expected=f">= {least} (planner.max_batch {self.planner.max_batch}, "
                f"{rows} row{'s' if rows > 1 else ''} per decoding request) while mixing "
                "(loop.mixed)",
                actual=self.loop.chunk_tokens,
            )
        check_ragged_cap(
            self.graphs.ragged_max_tokens,
            self.planner.max_batch,
            listed=self.graphs.token_sizes is not None,
            field="graphs.ragged_max_tokens",
        )
        self._check_distributed()
        self._check_batch_invariant()
        prompts = self.loop.requests * self.loop.prompt_len[1]
        if prompts > MAX_PROMPT_TOKENS:
            raise ConfigError(
                f"the workload's prompts could hold {prompts:,} tokens (requests x "
                f"prompt_len[1] = {self.loop.requests} x {self.loop.prompt_len[1]}), made up "
                "front in host memory; lower loop.requests or loop.prompt_len",
                field="loop.requests",
                expected=f"<= {MAX_PROMPT_TOKENS // self.loop.prompt_len[1]}",
                actual=self.loop.requests,
            )
        longest = self.loop.prompt_len[1] + self.loop.max_new_tokens[1] + spec.next_n
        if longest > self.planner.max_context:
            raise ConfigError(
                "below the longest request (prompt + new tokens + speculative.draft_tokens)",
                field="planner.max_context",
                expected=f">= {longest}",
                actual=self.planner.max_context,
            )
        pages = -(-longest // BLOCK_KV)
        if self.loop.kv_pages is not None and self.loop.kv_pages - 1 < pages:
            raise ConfigError(
                "KV cache cannot hold the longest request (page 0 is reserved)",
                field="loop.kv_pages",
                expected=f">= {pages + 1}",
                actual=self.loop.kv_pages,
            )

    def _check_batch_invariant(self) -> None:
        """What the batch-invariant mode cannot make invariant (yet), refused by name."""
        if not self.planner.batch_invariant:
            return
        if self.planner.mla_kernel == "flashinfer":
            raise ConfigError(
                "FlashInfer's MLA scheduler splits each row's KV by the whole batch",
                field="planner.mla_kernel",
                expected="auto, triton or torch with planner.batch_invariant",
                actual="flashinfer",
            )
        cuda = torch.device(self.device).type == "cuda"
        if self.planner.mla_kernel == "torch" and cuda:
            raise ConfigError(
                "the torch sparse MLA runs batched einsums whose cuBLAS algorithm follows the "
                "batch on CUDA (it ignores the planned split schedule)",
                field="planner.mla_kernel",
                expected="auto or triton with planner.batch_invariant on CUDA",
                actual="torch",
            )
        if self.distributed.tp > 1 and cuda:
            raise ConfigError(
                "NCCL's all-reduce of the heads' partial sums cuts its chunks by message size, so "
                "a row's sum order follows the batch",
                field="distributed.tp",
                expected="1 with planner.batch_invariant on CUDA (data-parallel attention is fine)",
                actual=self.distributed.tp,
            )

    def _check_distributed(self) -> None:
        d = self.distributed
        if d.backend == "nccl" and torch.device(self.device).type != "cuda":
            raise ConfigError(
                "NCCL carries CUDA tensors only",
                field="distributed.backend",
                expected="gloo or auto on the CPU",
                actual="nccl",
            )


def _format(exc: ValidationError, origin: str, overridden: Iterable[str]) -> ConfigError:
    """The first error, on its dotted field; the file is named only when the value came from
    it (a value an override set is the caller's to name: the CLI names its flag)."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "<root>"
    more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    value = first.get("input")
    shown = value if isinstance(value, (int, float, str, bool)) else None
    message = first["msg"].removeprefix("Value error, ")  # pydantic's wrapping of a ValueError
    if any(where == key or where.startswith(key + ".") for key in overridden):
        return ConfigError(f"{message}{more}", field=where, actual=shown)
    return ConfigError(f"{origin}: {message}{more}", field=where, actual=shown)


def shipped_configs() -> list[str]:
    """The names ``--config`` accepts besides a path: ``dsv32-tiny``, ``dsv32-small``, ..."""
    return sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.yaml"))


def resolve_config(value: str | Path) -> Path:
    """A run config's file: ``value`` as a path if it names a file, else a shipped config's
    name (``dsv32-tiny-spec``, with or without ``.yaml``), wherever the package is installed."""
    path = Path(value)
    if path.is_file():
        return path
    name = path.name[: -len(".yaml")] if path.name.endswith(".yaml") else path.name
    shipped = SHIPPED_CONFIGS / f"{name}.yaml"
    # a shipped name given with its old in-repository folder (``configs/dsv32-tiny.yaml``)
    if shipped.is_file() and (path.parent == Path(".") or path.parent.name == "configs"):
        return shipped
    if path.exists():
        raise ConfigError("not a file", field="--config", actual=str(value))
    raise ConfigError(
        f"no such file, and no shipped config of that name (shipped: {', '.join(shipped_configs())})",
        field="--config",
        actual=str(value),
    )


def load_run_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Read and validate a YAML run config (a path or a shipped config's name); ``overrides``
    are dotted keys (``planner.debug``)."""
    data: dict[str, Any] = {}
    origin = "defaults"
    if path is not None:
        path = resolve_config(path)
        origin = str(path)
        try:
            with open(path, encoding="utf-8") as stream:
                data = yaml.safe_load(stream) or {}
        except OSError as exc:
            raise ConfigError(
                f"cannot read config: {exc.strerror}", field="--config", actual=str(path)
            ) from None
        except UnicodeDecodeError:
            raise ConfigError(
                "not a text file (a YAML run config is UTF-8 text)",
                field="--config",
                actual=str(path),
            ) from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"not valid YAML: {exc}", field="--config", actual=origin) from None
        if not isinstance(data, dict):
            raise ConfigError(
                f"{origin}: top level must be a mapping", field="<root>", actual=type(data).__name__
            )
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    try:
        config = RunConfig.model_validate(data)
    except ValidationError as exc:
        raise _format(exc, origin, overrides or {}) from None
    config.check_fits()
    return config
