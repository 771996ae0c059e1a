"""Admission, KV page growth and batch building for the decode loop.

Everything a step needs is computed on the host from the requests' page
lists (slots, positions, lengths): the device is touched only to write a
request's ``req_to_token`` row when it gains a page.
"""

from __future__ import annotations

from collections import deque

import torch

from dsv32_engine.models.kv_cache import PagedKVCache, RequestPool
from dsv32_engine.serving.requests import Request
from dsv32_engine.serving.token_ids import TokenIds, last_of
from planner.batch import ForwardBatch, ForwardMode
from planner.planner import Planner
from planner.step_inputs import StepInputs


def slot_for(planner: Planner, mode: ForwardMode) -> StepInputs | None:
    """The planner's staging slot of the next ``mode`` step, where that mode is captured
    (the step is then written once, there); None otherwise."""
    return planner.step_inputs(mode) if planner.stages(mode) and not mode.stepped else None


def fed_id(request: Request, position: int, last_on_device: bool) -> int:
    """The input id that feeds ``request``'s token at ``position``: the token the host has,
    or ``last_of`` its row (the token it sampled last, which the device holds before the
    host does) for a generated one with ``last_on_device`` or one the host has not read."""
    prompt, generated = request.prompt, request.generated
    if position < len(prompt):
        return prompt[position]
    if not last_on_device and position - len(prompt) < len(generated):
        return generated[position - len(prompt)]
    return last_of(request.pool_idx)


def fed_ids(request: Request, first: int, n: int, last_on_device: bool) -> list[int]:
    """:func:`fed_id` of positions ``first .. first + n - 1``: the prompt's as one slice."""
    cut = max(first, min(first + n, len(request.prompt)))
    ids = list(request.prompt[first:cut])
    ids.extend(fed_id(request, p, last_on_device) for p in range(cut, first + n))
    return ids


class Scheduler:
    """Moves requests from waiting to running to finished, and builds each step's batch."""

    def __init__(
        self,
        cache: PagedKVCache,
        pool: RequestPool,
        max_batch: int,
        page_size: int,
        drafts: int = 0,
    ) -> None:
        self.cache = cache
        self.pool = pool
        self.max_batch = max_batch
        self.page_size = page_size
        self.token_ids = TokenIds(pool.req_to_token.shape[0], pool.req_to_token.device, drafts)
        """Every step's input ids on the device, each request's last sampled token, and its
        ``drafts`` drafts where they stay on the device (the MTP draft's)."""
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_count = 0
        """Requests finished so far (the requests themselves are not kept)."""

    def arrive(self, requests: list[Request]) -> None:
        self.waiting.extend(requests)

    def admit(self, next_n: int) -> int:
        """Start waiting requests, in arrival order, while their whole KV fits.

        Pages for the request's final length are taken up front, so a running
        request never waits for memory (no preemption needed) and its token
        row is written once.
        """
        admitted = 0
        while self.waiting and len(self.running) < self.max_batch and self.pool.num_free:
            request = self.waiting[0]
            final = len(request.prompt) + request.max_new_tokens + next_n
            need = -(-final // self.page_size)
            if self.cache.num_free_pages < need:
                break
            self.waiting.popleft()
            request.pool_idx = self.pool.alloc()
            request.pages = self.cache.alloc(need)
            self.pool.assign(
                request.pool_idx, request.pages, min(need * self.page_size, self.pool.max_context)
            )
            self.running.append(request)
            admitted += 1
        return admitted

    def slot(self, request: Request, position: int) -> int:
        page = request.pages[position // self.page_size]
        return page * self.page_size + position % self.page_size

    def slots(self, request: Request, first: int, n: int) -> list[int]:
        """The KV slots of positions ``first .. first + n - 1``: :meth:`slot` of each, built
        as one range per page they touch (a 2,048-token chunk is 32 ranges, not 2,048 calls)."""
        ps, out, position, end = self.page_size, [], first, first + n
        while position < end:
            index = position // ps
            stop = min(end, (index + 1) * ps)
            base = request.pages[index] * ps - index * ps
            out.extend(range(base + position, base + stop))
            position = stop
        return out

    def release(self, request: Request) -> None:
        """A request whose last token is launched (``spent``) leaves the running set and
        gives back its pages and token-table row, at the end of that step: the next step
        may admit a request into them. What it reuses is written by later work on the
        device's stream, behind the step still finishing, so a loop one step ahead admits
        what the synchronous loop admits. Its tokens may still be on their way (``finish``)."""
        self.running.remove(request)
        self.cache.free(request.pages)
        self.pool.free(request.pool_idx)
        request.pages = []

    def finish(self, request: Request, step: int) -> None:
        """Its last token read, at loop step ``step`` (released before)."""
        request.finish_step = step
        self.finished_count += 1

    def prefill_work(self, budget: int) -> list[tuple[Request, int]]:
        """Prompt chunks for this step: requests in admission order, filling ``budget`` tokens.

        Each request's chunk is what is left of its prompt, cut to what is left of the
        budget, so a loaded step holds exactly the budget (and fits its token bucket); a
        request the budget cannot reach waits for the next step, keeping admission order.
        Where a prompt is cut does not change what it computes: chunked prefill equals
        token-by-token prefill (``tests/serving/test_chunked_prefill.py``).
        """
        work = []
        for request in self.running:
            if budget <= 0:
                break
            if not request.prefilling:
                continue
            n = min(len(request.prompt) - request.fed, budget)
            work.append((request, n))
            budget -= n
        return work

    def step_work(
        self, budget: int, mixes: bool, rows: int = 1
    ) -> tuple[list[tuple[Request, int]], ForwardMode, list[Request]]:
        """This step's prompt chunks with their mode, and the requests that decode apart from
        them. Mixing (``mixes``), the decoding requests join the chunks as extends of their
        ``rows`` (one token; speculating, ``n`` verify rows: its last token and ``n - 1``
        drafts), in one mixed batch, nothing apart (a step of chunks alone is a mixed batch
        too, so one ragged graph per bucket serves both); their rows count against the
        step's token ``budget`` and the chunks take what they leave. Else the chunks are an
        extend batch of the whole budget and the decodes (or verifies) a step of their own;
        so is a mixing step with no chunk."""
        decoding = [r for r in self.running if not r.prefilling and not r.spent]
        if mixes:
            budget -= rows * len(decoding)
        work = self.prefill_work(budget)
        if work and mixes:  # chunks alone too: one mixed graph per bucket
            return work + [(r, rows) for r in decoding], ForwardMode.MIXED, []
        return work, ForwardMode.EXTEND, decoding

    def build_extend(
        self,
        work: list[tuple[Request, int]],
        mode: ForwardMode,
        inputs: StepInputs | None = None,
        *,
        last_on_device: bool = False,
        drafts: list[list[int] | None] | None = None,
    ) -> tuple[ForwardBatch, torch.Tensor]:
        """The batch and ``input_ids`` feeding ``n`` more tokens of each ``(request, n)``.

        Tokens ``fed .. fed + n - 1`` of each request, request-major: a prompt
        chunk, or (``n = 1``) a decode request's last token in a mixed batch. ``inputs``:
        the planner's staging slot of the step, written once as :meth:`build` does.
        ``last_on_device``: a generated token is the one the request sampled last, sent as
        ``last_of`` its row and resolved on the device by the step's forward
        (:class:`TokenIds`; the host may not have it yet). ``drafts`` (per entry, None for a
        chunk): a verify request's ``n`` rows, its next token then its first ``n - 1``
        drafts, as :meth:`build` lays a verify out.
        """
        lens, new, pools, locs, positions, ids = [], [], [], [], [], []
        for j, (request, n) in enumerate(work):  # a range per request and page, not per token
            first = request.fed
            lens.append(first + n)
            new.append(n)
            pools.append(request.pool_idx)
            positions.extend(range(first, first + n))
            locs.extend(self.slots(request, first, n))
            drafted = drafts[j] if drafts is not None else None
            if drafted is None:
                ids.extend(fed_ids(request, first, n, last_on_device))
            else:
                ids.append(fed_id(request, first, last_on_device))
                ids.extend(drafted[: n - 1])
        ids_dev = self.token_ids.send(ids)
        if inputs is not None and inputs.fits(len(lens), len(locs)):
            inputs.write(lens, new, pools, locs, positions)
            return inputs.batch(self.pool.req_to_token), ids_dev
        batch = ForwardBatch(
            seq_lens_cpu=torch.tensor(lens, dtype=torch.int32),
            req_pool_indices=torch.tensor(pools, dtype=torch.int32),
            req_to_token=self.pool.req_to_token,
            out_cache_loc=torch.tensor(locs, dtype=torch.int32),
            positions=torch.tensor(positions, dtype=torch.int32),
            mode=mode,
            extend_lens_cpu=torch.tensor(new, dtype=torch.int32),
        )
        return batch, ids_dev

    def idle(
        self, shape: ForwardMode = ForwardMode.DECODE, next_n: int = 1
    ) -> tuple[ForwardBatch, torch.Tensor]:
        """A batch with no request, for a rank with no work this step, in the ``shape`` of
        its peers' forward (decode; under speculation verify, draft extend or draft decode,
        with that mode's ``next_n``): it replays their graph with every row padding."""
        empty = torch.zeros(0, dtype=torch.int32)
        batch = ForwardBatch(
            seq_lens_cpu=empty,
            req_pool_indices=empty,
            req_to_token=self.pool.req_to_token,
            out_cache_loc=empty,
            mode=ForwardMode.IDLE,
            next_n=next_n,
            idle_as=shape,
        )
        device = self.pool.req_to_token.device
        return batch, torch.zeros(0, dtype=torch.int64, device=device)

    def idle_ragged(self, mode: ForwardMode) -> tuple[ForwardBatch, torch.Tensor]:
        """A ragged batch that touches nothing real, for a data-parallel rank with no work in
        a slot its peers replay as a ragged graph: one token of the null request (row 0 of
        the token table, written to the null slot 0), in the peers' ``mode``."""
        return self._null_extend(0, 1, mode)

    def _null_extend(
        self, prefix: int, tokens: int, mode: ForwardMode = ForwardMode.EXTEND
    ) -> tuple[ForwardBatch, torch.Tensor]:
        """``tokens`` new tokens after ``prefix`` on the null request: nothing real is read
        or written (row 0 of the token table, every token to the null slot 0)."""
        batch = ForwardBatch(
            seq_lens_cpu=torch.tensor([prefix + tokens], dtype=torch.int32),
            req_pool_indices=torch.zeros(1, dtype=torch.int32),
            req_to_token=self.pool.req_to_token,
            out_cache_loc=torch.zeros(tokens, dtype=torch.int32),
            mode=mode,
            extend_lens_cpu=torch.tensor([tokens], dtype=torch.int32),
        )
        device = self.pool.req_to_token.device
        return batch, torch.zeros(tokens, dtype=torch.int64, device=device)

    def warm_up_batches(
        self, topk: int, chunk: int, max_context: int
    ) -> list[tuple[ForwardBatch, torch.Tensor]]:
        """Extend batches on the null request (row 0, every token written to the null slot 0,
        which may repeat) at the shapes a first prefill meets: one token past ``topk`` of
        context (the prefill indexer's scored rows), and prompts of a few and of a whole
        chunk of tokens, with and without a cached prefix. Triton compiles a kernel once per
        tile size and deep_gemm once per shape class, and the tile sizes follow the rows (a
        MoE group's mean rows: 16, 32, 64): left to the first requests, those compiles were
        0.3-0.4 s of their time to first token on the H200. A prompt of 16 tokens (128 MoE
        pairs) compiles the MoE dispatch's middle sort width (``moe_dispatch_triton``)."""
        shapes = {(min(topk, max_context - 1), 1), (0, min(chunk, 16))}
        for tokens in {min(chunk, 128), chunk}:
            for prefix in (0, topk):
                if tokens >= 1 and prefix + tokens <= max_context:
                    shapes.add((prefix, tokens))
        return [self._null_extend(prefix, tokens) for prefix, tokens in sorted(shapes)]

    def build(
        self,
        requests: list[Request],
        mode: ForwardMode,
        next_n: int,
        drafts: list[list[int]] | None = None,
        inputs: StepInputs | None = None,
        *,
        last_on_device: bool = False,
    ) -> tuple[ForwardBatch, torch.Tensor]:
        """The batch and ``input_ids`` for feeding ``next_n`` tokens of each request.

        Row ``i`` of a request is position ``fed + i``: its own next token
        first, then its ``next_n - 1`` drafts (target verify). ``inputs``: the planner's
        staging slot of the step (``Planner.step_inputs``): the step is written there once
        and the batch is views of it, which a replay sends as it is. ``last_on_device``:
        a generated token is the one the request sampled last, sent as ``last_of`` its row
        (the step's forward resolves it on the device).
        """
        lens, pools, locs, positions, ids = [], [], [], [], []
        for j, request in enumerate(requests):
            first = request.fed
            lens.append(first + next_n)
            pools.append(request.pool_idx)
            positions.extend(range(first, first + next_n))
            locs.extend(self.slots(request, first, next_n))
            ids.append(fed_id(request, first, last_on_device))
            ids.extend(drafts[j][: next_n - 1] if next_n > 1 else ())
        ids_dev = self.token_ids.send(ids)
        if inputs is not None and inputs.fits(len(lens), len(locs)):
            inputs.write(lens, next_n, pools, locs, positions)
            return inputs.batch(self.pool.req_to_token, next_n), ids_dev
        batch = ForwardBatch(
            seq_lens_cpu=torch.tensor(lens, dtype=torch.int32),
            req_pool_indices=torch.tensor(pools, dtype=torch.int32),
            req_to_token=self.pool.req_to_token,
            out_cache_loc=torch.tensor(locs, dtype=torch.int32),
            positions=torch.tensor(positions, dtype=torch.int32),
            mode=mode,
            next_n=next_n,
        )
        return batch, ids_dev

    def build_draft_extend(self, work: list[tuple[Request, int, int]], next_n: int) -> ForwardBatch:
        """The draft's catch-up on ``(request, first position, accepted)``: positions
        ``first .. first + accepted - 1``, flat; the planner spreads them over ``next_n`` rows."""
        return self._span_batch(
            work,
            ForwardMode.DRAFT_EXTEND,
            next_n,
            extend_lens=torch.tensor([accepted for _, _, accepted in work], dtype=torch.int32),
        )

    def build_draft_decode(self, requests: list[Request], steps: int) -> ForwardBatch:
        """``steps`` one-token draft steps of each request at positions ``fed .. fed + steps - 1``
        (the KV length after the last step, every step's slot, request-major)."""
        work = [(request, request.fed, steps) for request in requests]
        return self._span_batch(work, ForwardMode.DRAFT_DECODE, steps)

    def _span_batch(
        self,
        work: list[tuple[Request, int, int]],
        mode: ForwardMode,
        next_n: int,
        extend_lens: torch.Tensor | None = None,
    ) -> ForwardBatch:
        """Each ``(request, first, n)`` as positions ``first .. first + n - 1`` and their slots,
        flat and request-major, with KV length ``first + n``."""
        lens, pools, locs, positions = [], [], [], []
        for request, first, n in work:
            lens.append(first + n)
            pools.append(request.pool_idx)
            positions.extend(range(first, first + n))
            locs.extend(self.slots(request, first, n))
        return ForwardBatch(
            seq_lens_cpu=torch.tensor(lens, dtype=torch.int32),
            req_pool_indices=torch.tensor(pools, dtype=torch.int32),
            req_to_token=self.pool.req_to_token,
            out_cache_loc=torch.tensor(locs, dtype=torch.int32),
            positions=torch.tensor(positions, dtype=torch.int32),
            mode=mode,
            next_n=next_n,
            extend_lens_cpu=extend_lens,
        )
