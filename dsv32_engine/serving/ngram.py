"""The n-gram draft: propose what followed the context's tail last time, no model needed.

Models repeat themselves (code, quotes, lists; a random-weight model keeps picking the
same successor of a token), so the token that followed the latest earlier occurrence of
the sequence's last ``n`` tokens is a cheap, often right guess of the next one. The
lookup is prompt lookup first (the request's own tokens, prompt and generated) and then
the tokens every request served so far has seen (a table shared by all requests, as
SGLang's n-gram drafts keep), longest matching ``n`` first (``ngram_max`` down to
``ngram_min``). Drafts are proposed one at a time, each extending the context the next
is looked up in, so a cycle is followed past the end of what was seen. With no match at
all the last token is repeated: a guess the verify step rejects, costing nothing.

Each table maps an n-gram to the token after its latest occurrence, updated as tokens
arrive, so a draft costs ``O(ngram_max)`` lookups whatever the lengths.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Table = dict[tuple[int, ...], int]


@dataclass
class NgramIndex:
    """One request's tokens and its table: n-gram -> the token that followed it last."""

    ngram_min: int
    ngram_max: int
    tokens: list[int] = field(default_factory=list)
    next_of: Table = field(default_factory=dict)

    def extend(self, tokens: list[int], shared: Table) -> None:
        """Append tokens; every n-gram now followed by one goes into both tables."""
        for token in tokens:
            end = len(self.tokens)  # the n-grams ending at end - 1 are followed by `token`
            for n in range(self.ngram_min, min(self.ngram_max, end) + 1):
                key = tuple(self.tokens[end - n : end])
                self.next_of[key] = shared[key] = token
            self.tokens.append(token)

    def propose(self, count: int, shared: Table) -> list[int]:
        """``count`` drafts continuing the tokens: own table first, then the shared one."""
        context = self.tokens[-self.ngram_max :] if self.tokens else [0]
        out: list[int] = []
        for _ in range(count):
            token = None
            for n in range(min(self.ngram_max, len(context)), self.ngram_min - 1, -1):
                key = tuple(context[-n:])
                token = self.next_of.get(key, shared.get(key))
                if token is not None:
                    break
            token = context[-1] if token is None else token
            out.append(token)
            context = [*context[1 - self.ngram_max :], token] if self.ngram_max > 1 else [token]
        return out


class NgramDraft:
    """n-gram drafts for every request (by id), over a table all of them feed."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.shared: Table = {}
        self._index: dict[int, NgramIndex] = {}

    def propose(self, rid: int, tokens: list[int], count: int) -> list[int]:
        """Drafts for request ``rid`` whose tokens so far are ``tokens`` (prompt + generated)."""
        index = self._index.get(rid)
        if index is None:
            index = self._index[rid] = NgramIndex(self.ngram_min, self.ngram_max)
        index.extend(tokens[len(index.tokens) :], self.shared)
        return index.propose(count, self.shared)

    def forget(self, rid: int) -> None:
        """A finished request's own table goes; what it taught the shared one stays."""
        self._index.pop(rid, None)
