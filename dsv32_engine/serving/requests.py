"""Requests and the synthetic workload: arrivals, prompts, output budgets.

Seeded, so two runs (with and without graphs, before and after a save and
load) see exactly the same traffic and can be compared token for token.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from dsv32_engine.serving.run_config import LoopSection


@dataclass
class Request:
    """One generation request and where its KV lives."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    arrival_step: int
    pool_idx: int = -1
    pages: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    fed: int = 0  # tokens whose KV is in the cache
    finish_step: int = -1
    arrived_at: float = 0.0  # wall clock (perf_counter) when the loop saw it arrive
    prefill_steps: int = 0  # extend steps that fed prompt tokens
    first_token_at: float | None = None
    drafts: list[int] = field(default_factory=list)
    """The draft tokens its next target verify checks (speculative decoding)."""
    in_flight: int = 0
    """Tokens sampled by launched steps and not yet read (a loop one step ahead)."""

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def prefilling(self) -> bool:
        """Prompt tokens are still to be fed (in chunks, by extend batches)."""
        return self.fed < len(self.prompt)

    def take(self, token: int, now: float) -> None:
        """Keep a generated token (the prediction after the last fed position)."""
        if self.first_token_at is None:
            self.first_token_at = now
        self.generated.append(token)

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.max_new_tokens

    @property
    def spent(self) -> bool:
        """Its last token is generated or on its way: no step feeds it again."""
        return len(self.generated) + self.in_flight >= self.max_new_tokens


def make_workload(loop: LoopSection, vocab_size: int) -> list[Request]:
    """``loop.requests`` requests with Poisson arrivals, random prompts and budgets."""
    rng = random.Random(loop.seed)
    step = 0
    out = []
    for rid in range(loop.requests):
        prompt_len = rng.randint(*loop.prompt_len)
        out.append(
            Request(
                rid=rid,
                prompt=[rng.randrange(vocab_size) for _ in range(prompt_len)],
                max_new_tokens=rng.randint(*loop.max_new_tokens),
                arrival_step=step,
            )
        )
        step += int(rng.expovariate(loop.arrival_rate))
    return out
