"""DeepSeek-V3.2's multi-token-prediction (MTP) layer, served as the speculative draft model.

The MTP module is one more decoder layer beside the target's 61. At position ``p``
it takes the target's last hidden state ``h_p`` and the embedding of the next token
``t_{p+1}``, normalises both (``hnorm``, ``enorm``), projects their concatenation back
to the model width (``eh_proj``), runs one decoder block with its own NSA attention
over its own KV and index cache, and predicts ``t_{p+2}`` through its final norm and
the target's head. Embedding and head are the target's (shared, not copied).

As a draft it runs in three kinds of batch, each reading only the plans it is given:

- catch-up: inside the target's forward of a prompt-chunk or mixed step, with its plans
  (the pairs sit at the rows' own positions and slots; ``Speculation.catch_up``);
- draft extend (``NSADraftExtendPlan``): the accepted tokens of a verify, ``next_n``
  rows per request; padding rows are zeroed before the layer and never read;
- draft decode (a stepped plan set): ``k`` one-token steps in one forward, step ``s``
  reading ``plans.step(s)`` and feeding its argmax and hidden state to step ``s + 1``,
  with no host sync between steps (one graph for all of them).

Every variant returns ``{"tokens": int64, "hidden": [reqs, dim]}``: each request's next
draft token(s) (``[reqs]``, or ``[reqs, k]`` for draft decode) and the hidden state
the next draft step starts from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from backends.nsa import NSADraftExtendPlan, NSAExtendPlan, NSAPlan
from backends.nsa_flashinfer import NSAFlashInferPlan
from dsv32_engine.models.config import DSV32Config
from dsv32_engine.models.init import random_init
from dsv32_engine.models.kv_cache import PagedKVCache
from dsv32_engine.models.layers.exact import Linear, set_batch_invariant
from dsv32_engine.models.layers.norm import RMSNorm
from dsv32_engine.models.layers.rope import rope_cos_sin
from dsv32_engine.models.model import Block, DSV32Model, FfnExchange
from planner.errors import PlanError
from planner.plans import PlanSet
from planner.schema import Plan


def mtp_config(target: DSV32Config) -> DSV32Config:
    """The MTP layer's own config: the target's, with one layer (MoE, as DeepSeek-V3's is)."""
    return DSV32Config.model_validate(
        {**target.model_dump(), "num_hidden_layers": 1, "first_k_dense_replace": 0}
    )


class MTPDraft(nn.Module):
    """The MTP layer over a target model: see the module docstring.

    Without trained weights (``load_state_dict`` replaces them) the layer is random but
    for ``eh_proj``, which starts as the identity on the embedding half: the draft then
    proposes what the shared head makes of the next token's embedding plus one random
    layer, which is most of what a random-weight target computes (its residual stream
    is the embedding plus depth-scaled layer outputs), so its drafts get accepted now
    and then, as a trained MTP layer's would be far more often.
    """

    PLANS: ClassVar[dict[str, tuple[type[Plan], ...]]] = {"nsa": (NSAPlan, NSAExtendPlan)}
    """The plans its layer reads (draft extend's is an NSAPlan; prefill reads extend plans)."""
    OPTIONAL_PLANS: ClassVar[dict[str, tuple[type[Plan], ...]]] = DSV32Model.OPTIONAL_PLANS
    """FlashInfer's sparse MLA plan of draft-decode steps, when the planner makes one."""

    def __init__(self, target: DSV32Model, *, seed: int = 1) -> None:
        super().__init__()
        cfg = mtp_config(target.config)
        self.config = cfg
        self.dtype = target.dtype
        object.__setattr__(self, "target", target)  # shared embedding and head: not submodules
        dim, eps = cfg.hidden_size, cfg.rms_norm_eps
        with torch.device("meta"):
            self.enorm = RMSNorm(dim, eps)
            self.hnorm = RMSNorm(dim, eps)
            self.eh_proj = Linear(2 * dim, dim, bias=False, dtype=target.dtype)
            self.block = Block(cfg, 0, target.dtype)
            self.norm = RMSNorm(dim, eps)
        self.requires_grad_(False)
        self.to_empty(device=target.device)
        self.block.attn.indexer.reset_buffers()
        random_init(self, seed, target.config.num_hidden_layers + 1)
        with torch.no_grad():  # see the class docstring: random weights, a sensible start
            self.eh_proj.weight.zero_()
            self.eh_proj.weight[:, :dim].copy_(torch.eye(dim, dtype=self.eh_proj.weight.dtype))
        if target.device.type == "cuda":  # as the target's layers (DSV32Model.__init__)
            self.block.fuse_projections()

    def shard_attention_heads(
        self, rank: int, world: int, reduce: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """Tensor parallel, as the target's layers (``DSV32Model.shard_attention_heads``): this
        rank's share of the layer's heads, ``wo``'s partial sums through ``reduce``."""
        self.block.attn.shard_heads(rank, world, reduce)

    def set_ffn_exchange(self, exchange: FfnExchange | None) -> None:
        """Run the layer's MoE through ``exchange``, as the target's (data-parallel attention:
        every draft forward exchanges rows with the peers, in lockstep like the target's)."""
        self.block.exchange = exchange

    batch_invariant: bool = False
    """The draft's batch-invariant mode (``set_batch_invariant``)."""

    def set_batch_invariant(self, on: bool) -> list[str]:
        """The batch-invariant mode of the draft's own modules (``eh_proj``, the layer's
        GEMMs; see ``DSV32Model.set_batch_invariant``) and of its use of the target's shared
        head, which runs in the draft's mode whatever the target's. Returns the names of
        the modules set."""
        return set_batch_invariant(self, on)

    def new_cache(self, num_pages: int) -> PagedKVCache:
        """The layer's own KV and index cache over the target's page ids (same slots)."""
        return PagedKVCache(self.config, num_pages, device=self.target.device, dtype=self.dtype)

    def layer(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        plan: NSAPlan | NSAExtendPlan,
        cache: PagedKVCache,
        valid: torch.Tensor | None = None,
        sparse: NSAFlashInferPlan | None = None,
    ) -> torch.Tensor:
        """One MTP step over rows of ``(token, hidden)`` pairs: the normed output hidden state
        (what the head reads, and the next step's input). ``valid`` zeroes padding rows;
        ``sparse`` is the step's FlashInfer sparse MLA plan when the planner makes one."""
        self._check(input_ids, hidden, plan, cache)
        target = self.target
        e = self.enorm(target.embed(input_ids))
        h = self.hnorm(hidden.to(self.dtype))
        if valid is not None:
            keep = valid.to(e.dtype).unsqueeze(1)
            e, h = e * keep, h * keep
        x = self.eh_proj(torch.cat([e, h], dim=-1))
        cos, sin = rope_cos_sin(plan.positions, target.inv_freq, target.rope_factor)
        x = self.block(x, cos, sin, plan, cache.mla[0], cache.index[0], sparse)
        return self.norm(x)

    def _next(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.head.project(hidden, self.batch_invariant).float().argmax(dim=-1)

    def forward(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, plans: PlanSet, cache: PagedKVCache
    ) -> dict[str, torch.Tensor]:
        """Each request's next draft token(s) and the hidden state to continue from."""
        if plans.steps:
            return self._decode_steps(input_ids, hidden, plans, cache)
        plan = plans["nsa"]
        if isinstance(plan, NSADraftExtendPlan):
            rows = plan.row_tokens.long()  # flat accepted tokens -> next_n rows per request
            out = self.layer(input_ids[rows], hidden[rows], plan, cache, plan.row_valid)
        else:
            out = self.layer(input_ids, hidden, plan, cache, sparse=plans.get("nsa_flashinfer"))
        if isinstance(plan, (NSADraftExtendPlan, NSAExtendPlan)):
            # each request's last (accepted) token; a mixed batch's last logit_n, flat
            out = out[plan.logit_rows.long().view(-1)]
        return {"tokens": self._next(out), "hidden": out}

    def _decode_steps(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, plans: PlanSet, cache: PagedKVCache
    ) -> dict[str, torch.Tensor]:
        tokens = []
        for s in range(len(plans.steps)):
            step = plans.step(s)
            hidden = self.layer(
                input_ids, hidden, step["nsa"], cache, sparse=step.get("nsa_flashinfer")
            )
            input_ids = self._next(hidden)
            tokens.append(input_ids)
        return {"tokens": torch.stack(tokens, dim=1), "hidden": hidden}

    def _check(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        plan: NSAPlan | NSAExtendPlan,
        cache: PagedKVCache,
    ) -> None:
        """Static agreement of inputs, plan and cache (shapes and attributes only)."""
        rows = plan.positions.shape[0]
        if input_ids.shape != (rows,) or hidden.shape != (rows, self.config.hidden_size):
            raise PlanError(
                "one token and one target hidden state per plan row",
                field="input_ids",
                expected=f"[{rows}] and [{rows}, {self.config.hidden_size}]",
                actual=(tuple(input_ids.shape), tuple(hidden.shape)),
            )
        if plan.topk != self.config.index_topk or cache.config != self.config:
            raise PlanError(
                "plan or cache made for another model",
                field="cache" if cache.config != self.config else "topk",
                expected=self.config.index_topk,
                actual=plan.topk,
            )
