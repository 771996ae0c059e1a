"""Greedy acceptance: keep the drafts the target agrees with, then the target's own token.

A verify row ``i`` of a request holds the target's argmax after its last token and the
first ``i`` drafts. Drafts ``d_1..d_j`` are right exactly when each equals the argmax of
the row before it; the target's argmax after the last right draft (the bonus token) is
correct too. So the accepted tokens are the argmax of rows ``0..j``, ``j + 1`` of them,
and they are what plain greedy decoding would have produced, one step at a time.
"""

from __future__ import annotations

from collections.abc import Sequence


def accept_greedy(drafts: Sequence[int], argmax: Sequence[int]) -> list[int]:
    """The tokens a verify accepts: ``argmax[0..j]`` for the longest agreeing prefix ``j``.

    ``drafts`` has ``n - 1`` tokens, ``argmax`` the target's ``n`` rows.
    """
    if len(argmax) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} verify rows")
    j = 0
    while j < len(drafts) and drafts[j] == argmax[j]:
        j += 1
    return list(argmax[: j + 1])
