"""The DeepSeek-V3.2 decoder that consumes plans.

``forward(input_ids, plans, cache)`` runs one decode step of every row of a
(padded) batch. It reads the NSA plan for positions and cache slots and
passes the plan on to the attention backends; it computes no batch metadata
of its own. ``PLANS`` says which plan schemas it reads: the engine checks the
planner plans them once, when it is built, so layers read typed fields. The forward has no host syncs, no data-dependent shapes and no
branching on tensor values, so the graph runner can capture it whole.

Weights are random (deterministic per seed and device type), scaled so the
residual stream stays O(1) through all layers; ``save``/``load`` round-trip
them bit-exactly through safetensors with the config in the metadata.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import ValidationError
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from backends.nsa import NSAExtendPlan, NSAPlan
from backends.nsa_flashinfer import NSAFlashInferPlan
from dsv32_engine.models.config import DSV32Config
from dsv32_engine.models.init import random_init
from dsv32_engine.models.kv_cache import PagedKVCache
from dsv32_engine.models.layers.exact import Linear, set_batch_invariant
from dsv32_engine.models.layers.ffn import MLP, MoE
from dsv32_engine.models.layers.mla import MLA
from dsv32_engine.models.layers.norm import RMSNorm
from dsv32_engine.models.layers.residual import add_rms_norm
from dsv32_engine.models.layers.rope import rope_cos_sin, yarn_attention_factor, yarn_inv_freq
from planner.errors import ConfigError, PlanError
from planner.plans import PlanSet
from planner.schema import Plan

FORMAT = "forward-planner/dsv32"


@contextmanager
def _open_weights(path: str | Path, **kwargs: str) -> Iterator[Any]:
    """``safe_open``, with a file that is not safetensors (truncated, corrupt, a directory)
    refused as a ``ConfigError`` naming it instead of safetensors' own error."""
    try:
        with safe_open(str(path), framework="pt", **kwargs) as f:
            yield f
    except (SafetensorError, OSError) as exc:
        raise ConfigError(
            f"{path} is not a readable safetensors file: {exc}", field="weights"
        ) from None


FfnExchange = Callable[[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]], torch.Tensor]
"""``exchange(x, ffn) -> ffn's output for x's rows``: how a data-parallel rank runs its FFN
over every rank's rows (a collective in every layer); see ``DSV32Model.set_ffn_exchange``."""


class Block(nn.Module):
    """Pre-norm decoder layer: ``h += attn(norm(h)); h += ffn(norm(h))``."""

    exchange: FfnExchange | None = None

    def __init__(self, cfg: DSV32Config, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = MLA(cfg, dtype)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.is_moe_layer(layer):
            self.ffn: nn.Module = MLP(cfg.hidden_size, cfg.intermediate_size, dtype)
        elif cfg.moe_stand_in_dim is not None:
            self.ffn = MLP(cfg.hidden_size, cfg.moe_stand_in_dim, dtype)
        else:
            self.ffn = MoE(cfg, dtype)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: NSAPlan | NSAExtendPlan,
        kv_cache: torch.Tensor,
        index_cache: torch.Tensor,
        sparse: NSAFlashInferPlan | None = None,
        *,
        delta: torch.Tensor | None = None,
        defer: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``h`` after this layer; ``defer`` returns ``(h, ffn_out)`` unsummed instead, for
        the next layer to take as ``delta``: each residual add then runs inside the launch
        of the norm that follows it (``add_rms_norm``), one kernel where there were two."""
        if delta is None:
            x = self.attn_norm(h)
        else:
            h, x = add_rms_norm(h, delta, self.attn_norm)
        a = self.attn(x, cos, sin, plan, kv_cache, index_cache, sparse)
        h, x = add_rms_norm(h, a, self.ffn_norm)
        f = self.ffn(x) if self.exchange is None else self.exchange(x, self.ffn)
        return (h, f) if defer else h + f

    def fuse_projections(self) -> None:
        """Projections that read the same input run as one GEMM (see ``FusedWeights``)."""
        self.attn.fuse_projections()
        mlp = self.ffn if isinstance(self.ffn, MLP) else getattr(self.ffn, "shared", None)
        if mlp is not None:
            mlp.fuse_projections()


class DSV32Model(nn.Module):
    """Embedding, ``num_hidden_layers`` blocks, final norm and LM head."""

    PLANS: ClassVar[dict[str, tuple[type[Plan], ...]]] = {"nsa": (NSAPlan, NSAExtendPlan)}
    """The plans the layers read, by backend: whatever the planner makes must be one of these."""
    OPTIONAL_PLANS: ClassVar[dict[str, tuple[type[Plan], ...]]] = {
        "nsa_flashinfer": (NSAFlashInferPlan,)
    }
    """Plans the layers read when the planner makes them (FlashInfer's sparse MLA plan)."""

    def __init__(
        self,
        config: DSV32Config,
        *,
        seed: int | None = 0,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        """Build on ``device`` and fill weights from ``seed``.

        ``seed=None`` leaves weights uninitialised (for ``load``); on the
        ``meta`` device nothing is allocated (for counting parameters).
        """
        super().__init__()
        self.config = config
        self.dtype = dtype
        device = torch.device(device)
        # Built on meta then materialised: no default init, no global RNG use.
        with torch.device("meta"):
            # _weight skips nn.Embedding's normal_ init (slow on meta the first time).
            self.embed = nn.Embedding(
                config.vocab_size,
                config.hidden_size,
                _weight=torch.empty(config.vocab_size, config.hidden_size, dtype=dtype),
            )
            self.layers = nn.ModuleList(
                Block(config, i, dtype) for i in range(config.num_hidden_layers)
            )
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.head = Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.register_buffer(
            "inv_freq", torch.empty(config.qk_rope_head_dim // 2), persistent=False
        )
        self.rope_factor = yarn_attention_factor(config.rope_scaling)
        self.requires_grad_(False)  # a serving model: no autograd bookkeeping per step
        if device.type != "meta":
            self.to_empty(device=device)
            self._reset_buffers()
            if seed is not None:
                self._init_weights(seed)
        if device.type == "cuda":  # the CPU keeps its batch-invariant per-layer float64 path
            for block in self.layers:
                block.fuse_projections()

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    def first_of_each_kind(self) -> list[int]:
        """The first layer of each kind: blocks whose modules and weights' shapes and dtypes
        match are one kind (DeepSeek-V3.2: the dense layers, the MoE layers). A forward over
        these alone (``forward(layers=...)``) launches every kernel, at every shape, that the
        whole forward does: a graph's warm-up, in a 61-layer model half of each capture."""
        seen: dict[tuple, int] = {}
        for i, block in enumerate(self.layers):
            kind = tuple(
                (
                    name,
                    type(module).__name__,
                    tuple((p.shape, p.dtype) for p in module.parameters(recurse=False)),
                )
                for name, module in block.named_modules()
            )
            seen.setdefault(kind, i)
        return sorted(seen.values())

    @property
    def attention_heads(self) -> int:
        """Attention heads this model computes: all of them, or this rank's share."""
        return self.layers[0].attn.n_heads if len(self.layers) else 0

    def shard_attention_heads(
        self, rank: int, world: int, reduce: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """Tensor parallel: keep this rank's ``H / world`` heads of every layer (``wq_b`` and
        ``wkv_b`` rows, ``wo`` columns); ``reduce`` all-reduces ``wo``'s partial sums.

        Everything else (embedding, norms, the indexer, the FFN, the head, the KV cache) stays
        whole on every rank. Call before any graph is captured; saving is refused after.
        """
        heads = self.config.num_attention_heads
        if world < 1 or heads % world:
            raise ConfigError(
                "tensor-parallel ranks must divide the attention heads",
                field="distributed.tp",
                expected=f"a divisor of num_attention_heads = {heads}",
                actual=world,
            )
        for block in self.layers:
            block.attn.shard_heads(rank, world, reduce)
        self.sharded = (rank, world)

    def set_ffn_exchange(self, exchange: FfnExchange | None) -> None:
        """Run every layer's FFN through ``exchange`` (``None``: locally, the default).

        Data-parallel attention gives each rank its own requests but runs the MoE over
        every rank's tokens; the exchange is that collective, injected so this package
        needs no distributed code. It must keep the rows' own outputs (replicated FFN
        weights do), and it runs inside captured graphs like the rest of the forward.
        """
        for block in self.layers:
            block.exchange = exchange

    batch_invariant: bool = False
    """Whether ``set_batch_invariant`` turned the batch-invariant mode on (for reports)."""

    def set_batch_invariant(self, on: bool) -> list[str]:
        """Turn the batch-invariant mode on or off (off: the default): with it on, every GEMM
        of the forward on CUDA runs a kernel whose tiles do not depend on the batch's rows
        (``invariant_gemm``; the routed experts a fixed-tile grouped GEMM, their combine a
        fixed add order, the indexer's head weights one path at every row count), so a row's
        logits are the same bits alone or in any batch. Off CUDA it changes nothing: the CPU
        model is invariant already (``exact``).

        A plain attribute on each module that has a GEMM (``exact.set_batch_invariant``; no
        global state: two models in one process may differ). Call it before graphs are
        captured: a captured graph keeps the kernels of the mode it was captured in.
        Returns the names of the modules set."""
        return set_batch_invariant(self, on)

    def _reset_buffers(self) -> None:
        cfg = self.config
        inv = yarn_inv_freq(
            cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings
        )
        self.inv_freq.copy_(inv)
        for block in self.layers:
            block.attn.indexer.reset_buffers()

    def _init_weights(self, seed: int) -> None:
        random_init(self, seed, self.config.num_hidden_layers)

    def param_count(self) -> int:
        """Number of parameters (equals ``config.param_count()``)."""
        return sum(p.numel() for p in self.parameters())

    def new_cache(self, num_pages: int) -> PagedKVCache:
        """A KV cache matching this model's config, device and dtype."""
        return PagedKVCache(self.config, num_pages, device=self.device, dtype=self.dtype)

    def _check(
        self, input_ids: torch.Tensor, plan: NSAPlan | NSAExtendPlan, cache: PagedKVCache
    ) -> None:
        """Static (shape/attribute) agreement of ids, plan and cache; no tensor reads."""
        rows = input_ids.shape[0]
        tokens = plan.kv_lens.shape[0]  # an op output over the plan's query rows
        if input_ids.dim() != 1 or tokens != rows:
            raise PlanError(
                "input_ids must hold one id per query token, request-major",
                field="input_ids",
                expected=f"[{tokens}]",
                actual=tuple(input_ids.shape),
            )
        for name in ("positions", "out_cache_loc"):
            shape = tuple(getattr(plan, name).shape)
            if shape != (rows,):
                raise PlanError(
                    "one entry per query row", field=name, expected=(rows,), actual=shape
                )
        topk = plan.topk
        if topk != self.config.index_topk:
            raise PlanError(
                "plan top-k differs from the model's index_topk",
                field="topk",
                expected=self.config.index_topk,
                actual=topk,
            )
        if len(cache.mla) != len(self.layers) or cache.config != self.config:
            raise PlanError(
                "KV cache was built for another config",
                field="cache",
                expected=self.config.num_hidden_layers,
                actual=len(cache.mla),
            )

    def forward(
        self,
        input_ids: torch.Tensor,
        plans: PlanSet,
        cache: PagedKVCache,
        *,
        hidden: bool = False,
        layers: Sequence[int] | None = None,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Next-token logits fp32 for one step; writes this step's KV.

        ``[rows, vocab]`` for a decode or verify batch (a row per query token),
        ``[reqs * logit_n, vocab]`` for an extend or mixed batch: only each request's last
        token predicts anything (a mixed batch's verify request: its last ``next_n``), so the
        head runs on the plan's ``logit_rows`` alone, request-major.
        ``hidden=True`` returns ``{"logits", "hidden"}``, the final normed hidden
        state of every row or token (what an MTP draft is fed).
        ``layers`` runs those layers alone (``first_of_each_kind``: a graph's warm-up, whose
        output is thrown away), the others skipped; the default runs every layer.
        """
        plan: NSAPlan | NSAExtendPlan = plans["nsa"]
        sparse: NSAFlashInferPlan | None = plans.get("nsa_flashinfer")
        self._check(input_ids, plan, cache)
        cos, sin = rope_cos_sin(plan.positions, self.inv_freq, self.rope_factor)
        h, delta = self.embed(input_ids), None
        for i in range(len(self.layers)) if layers is None else layers:
            h, delta = self.layers[i](
                h, cos, sin, plan, cache.mla[i], cache.index[i], sparse, delta=delta, defer=True
            )
        ragged = isinstance(plan, NSAExtendPlan)
        # a ragged batch's logit rows, flat: each request's last logit_n rows, request-major
        rows = plan.logit_rows.long().view(-1) if ragged else None
        if rows is not None and not hidden:  # only the logit rows are normalised
            h = h if delta is None else h + delta
            return self.head(self.norm(h[rows])).float()
        # The last layer's FFN output joins the stream in the final norm's launch.
        normed = self.norm(h) if delta is None else add_rms_norm(h, delta, self.norm)[1]
        if not hidden:
            return self.head(normed).float()
        last = normed[rows] if rows is not None else normed
        return {"logits": self.head(last).float(), "hidden": normed}

    # ------------------------------------------------------------- persistence

    sharded: tuple[int, int] | None = None
    """``(rank, world)`` once ``shard_attention_heads`` kept one rank's heads."""

    def save(self, path: str | Path) -> None:
        """Weights as safetensors; config and dtype in the metadata (never pickle)."""
        if self.sharded is not None:
            raise ConfigError(
                "a head-sharded model holds one rank's heads",
                field="save",
                expected="the unsharded model",
                actual=self.sharded,
            )
        tensors = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        meta = {"format": FORMAT, "config": self.config.model_dump_json(), "dtype": str(self.dtype)}
        save_file(tensors, str(path), metadata=meta)

    @staticmethod
    def read_config(path: str | Path) -> tuple[DSV32Config, dict[str, str]]:
        """The config (and raw metadata) stored in a saved model file."""
        with _open_weights(path) as f:
            meta = f.metadata() or {}
        if meta.get("format") != FORMAT or "config" not in meta:
            raise ConfigError(
                f"{path} is not a saved DSV32Model",
                field="format",
                expected=FORMAT,
                actual=meta.get("format"),
            )
        try:
            return DSV32Config.model_validate_json(meta["config"]), meta
        except ValidationError as exc:
            raise ConfigError(
                f"{path}: the stored model config does not validate: {exc.errors()[0]['msg']}",
                field="config",
            ) from None

    @torch.no_grad()
    def load(self, path: str | Path) -> DSV32Model:
        """Load weights saved by ``save``; the stored config, names, shapes and dtypes must match."""
        stored, _ = self.read_config(path)
        if stored != self.config:
            a, b = stored.model_dump(), self.config.model_dump()
            diff = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
            first = next(iter(diff))
            raise ConfigError(
                f"{path} holds another config; differing fields (stored, model): {diff}",
                field=first,
                expected=b[first],
                actual=a[first],
            )
        own = self.state_dict()
        with _open_weights(path, device=str(self.device)) as f:
            keys = set(f.keys())
            if keys != set(own):
                raise ConfigError(
                    f"{path}: tensor names differ",
                    field="state_dict",
                    expected=sorted(set(own) - keys),
                    actual=sorted(keys - set(own)),
                )
            for name, dst in own.items():
                src = f.get_tensor(name)
                if src.shape != dst.shape or src.dtype != dst.dtype:
                    raise ConfigError(
                        f"{path}: tensor {name} differs",
                        field=name,
                        expected=(tuple(dst.shape), dst.dtype),
                        actual=(tuple(src.shape), src.dtype),
                    )
                dst.copy_(src)
        return self

    @classmethod
    def from_file(cls, path: str | Path, *, device: torch.device | str = "cpu") -> DSV32Model:
        """A model built from the config stored in ``path``, with its weights and dtype."""
        config, meta = cls.read_config(path)
        dtype = getattr(torch, meta.get("dtype", "torch.bfloat16").removeprefix("torch."))
        return cls(config, seed=None, device=device, dtype=dtype).load(path)
