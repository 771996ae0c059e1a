"""The extend batch's per-token lists built by ranges (a range per page, the prompt as a slice)
equal the per-token definitions (``Scheduler.slot``, ``fed_id``) on random requests."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dsv32_engine.serving.requests import Request
from dsv32_engine.serving.scheduler import Scheduler, fed_id, fed_ids


@st.composite
def requests(draw):
    page = draw(st.sampled_from([1, 2, 4, 64]))
    prompt = draw(st.lists(st.integers(0, 99), min_size=1, max_size=40))
    generated = draw(st.lists(st.integers(0, 99), max_size=10))
    length = len(prompt) + len(generated) + 1
    pages = draw(
        st.lists(st.integers(1, 500), min_size=-(-length // page), max_size=-(-length // page))
    )
    request = Request(0, prompt, 64, 0, pool_idx=draw(st.integers(0, 7)), pages=pages)
    request.generated = generated
    first = draw(st.integers(0, length - 1))
    n = draw(st.integers(1, length - first))
    return page, request, first, n


@given(requests(), st.booleans())
def test_ranges_equal_the_per_token_definitions(case, last_on_device):
    page, request, first, n = case
    scheduler = Scheduler.__new__(Scheduler)  # slot() reads only the page size
    scheduler.page_size = page
    positions = range(first, first + n)
    assert scheduler.slots(request, first, n) == [scheduler.slot(request, p) for p in positions]
    want = [fed_id(request, p, last_on_device) for p in positions]
    assert fed_ids(request, first, n, last_on_device) == want
