"""Whole postings lists of a search's terms, kept in memory while their terms stay unchanged.

    lists = TermLists(budget_bytes=256 << 20)
    async with store.snapshot():  # one REPEATABLE READ transaction
        postings = await lists.get(connection, term_key, version, rescaling)  # version: list_version(...)
        postings.keys, postings.parts  # every posting of the term: chunk keys, term-frequency parts

Why: at a million chunks a title such as "Uses of Class X (Java SE 17 & JDK 17)" holds six terms of
220–475k postings each whose impacts hardly differ, and proving its exact top 30 from the
impact-ordered index reads most of those lists (0.07 µs a posting for the index scan alone, 0.26 with
the aggregation: 1–2 s a search). The same two million postings held as arrays sum in numpy in about
15 ms (``ImpactOrderedPostings``, "whole lists").

When a list is still right: every statement that adds or removes a posting of a (field, lexeme)
inserts, updates or deletes that lexeme's ``keyword_df`` rows in the same transaction (migration
0017's triggers), and every row version carries the id of the transaction that wrote it (``xmin``);
``keyword_reference``'s row is rewritten with every impact (``keyword_refresh_impacts``). So the
sorted ``xmin``s of a term's ``keyword_df`` rows, with that of ``keyword_reference``, name the state
of its postings: read in a search's snapshot and equal to those a list was loaded under, the list is
what that snapshot holds. A list is loaded in the snapshot that read its version, so the two agree.
A list holds a bound of each posting's term-frequency part under the current average lengths
(``Rescaling``), not its stored impact: summed with the terms' idf, a chunk's bound is within about a
percent of its exact score, so few chunks beyond those that enter the top-k are scored. The least
recently used lists go once the arrays pass ``budget_bytes``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from time import monotonic
from typing import Any

import numpy as np
import numpy.typing as npt

from ragstream.metrics import KEYWORD_LISTS_BYTES, KEYWORD_LISTS_LOADED

__all__ = ["Rescaling", "TermList", "TermLists", "list_version"]

# A term's postings, for COPY in binary: per row a field count, then each field's length and value.
# Only what the (term, impact) index holds, so that the scan never reads the table (0.2 µs a posting
# against 2.8 with tf and field from the heap, at a million chunks).
_POSTINGS = "SELECT chunk_key, impact FROM keyword_postings WHERE term = $1"
_ROW = np.dtype([("fields", ">i2"), ("key_length", ">i4"), ("key", ">i8"), ("impact_length", ">i4"), ("impact", ">f4")])
_SIGNATURE = b"PGCOPY\n\xff\r\n\x00"


def list_version(row_versions: Sequence[int], reference_version: int) -> tuple[int, ...]:
    """The version of a term's postings: its ``keyword_df`` rows' transaction ids, sorted, then the
    reference row's."""
    return (*sorted(row_versions), reference_version)


@dataclass(frozen=True, slots=True)
class Rescaling:
    """From a stored impact (the term-frequency part under the reference average lengths) to a bound
    of the part under the current ones, which a search's exact scores use: BM25's ``k1`` and ``b``,
    and per field (words, bigrams) the reference and the current average length.

    With ``g = (tf + k1·(1−b)) / (tf·(k1+1))`` an impact is ``1 / (g + k1·b·dl / (tf·(k1+1)·A))``, so
    under ``A`` with ``r = A_ref/A`` the part is ``1 / ((1−r)·g + r/impact)``. ``tf`` is not read (the
    index holding the impacts does not hold it), so ``g`` takes its value that makes the part largest:
    ``1/(k1+1)`` (tf without end) when ``r ≤ 1``; when ``r > 1``, its value at tf 1,
    ``(1+k1·(1−b))/(k1+1)``, or ``1/impact`` if less (an impact is at most ``1/g``). That bound is
    tight within about a percent for the drifts a corpus sees; where it is not defined (a growth past
    about 7×) or looser, the stored impact times ``max(1, 1/r)`` bounds it instead. The
    stored impact's float4 rounding moves the result by about 1e-7 of itself, which the search's
    bound slack (1e-6) covers; the result is rounded up to float4.
    """

    k1: float
    b: float
    reference: tuple[float, float]
    current: tuple[float, float]

    def parts(self, impacts: npt.NDArray[np.float32], field: int) -> npt.NDArray[np.float32]:
        """Bounds of the current parts of ``impacts``, all of one ``field`` (0 words, 1 bigrams)."""
        ratio = _ratio(self.reference[field], self.current[field])
        stored = impacts.astype(np.float64)
        drifted = stored * max(1.0, 1 / ratio)
        if ratio <= 1:
            g: float | npt.NDArray[np.float64] = 1 / (self.k1 + 1)
        else:  # at most its value at tf 1, and at most 1/impact (an impact is at most 1/g)
            g = np.minimum((1 + self.k1 * (1 - self.b)) / (self.k1 + 1), 1 / stored)
        denominators = (1 - ratio) * g + ratio / stored
        parts = np.where(denominators > 0, 1 / np.maximum(denominators, 1e-300), np.inf)
        bounded = np.minimum(parts, drifted)
        rounded: npt.NDArray[np.float32] = bounded.astype(np.float32)
        below = rounded < bounded
        rounded[below] = np.nextafter(rounded[below], np.float32(np.inf))
        return rounded


def _ratio(reference: float, current: float) -> float:
    """A_ref / A; 1 where a field has no average (no chunk holds it, so no posting of it exists)."""
    return reference / current if reference > 0 and current > 0 else 1.0


@dataclass(frozen=True, slots=True)
class TermList:
    """Every posting of one term: chunk keys and their term-frequency parts under ``rescaling``'s
    current averages, in no particular order."""

    version: tuple[int, ...]
    rescaling: Rescaling
    keys: npt.NDArray[np.int64]
    parts: npt.NDArray[np.float32]
    low: int  # the least key (0 for an empty list)
    high: int  # the greatest key

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.parts.nbytes)


class TermLists:
    """Term lists in memory, each loaded once per version, least recently used evicted past the budget.

    ``reload_after_s``: a term loaded less than this long ago is not loaded again for another version;
    its searches take the rounds meanwhile. While a sync commits, a frequent term changes with nearly
    every commit, and loading its list for each search would cost more than the rounds it saves.
    """

    BYTES_PER_POSTING = 12

    def __init__(self, budget_bytes: int, *, reload_after_s: float = 10.0) -> None:
        if budget_bytes < 0 or reload_after_s < 0:
            raise ValueError("budget_bytes and reload_after_s must not be negative")
        self.budget_bytes = budget_bytes
        self.reload_after_s = reload_after_s
        self._lists: OrderedDict[int, TermList] = OrderedDict()
        self._loaded_at: dict[int, float] = {}  # terms loaded within reload_after_s, and when
        self._used = 0
        self.loaded = 0  # lists read from the database, for benchmarks and tests

    @property
    def used(self) -> int:
        """Bytes of the lists kept."""
        return self._used

    def holds(self, term: int, version: tuple[int, ...], rescaling: Rescaling) -> bool:
        """Whether ``term``'s list is kept at ``version`` and under ``rescaling``."""
        kept = self._lists.get(term)
        return kept is not None and (kept.version, kept.rescaling) == (version, rescaling)

    def may_load(self, term: int, version: tuple[int, ...], rescaling: Rescaling) -> bool:
        """Whether ``term``'s list at ``version`` is kept or may be loaded now."""
        if self.holds(term, version, rescaling):
            return True
        loaded_at = self._loaded_at.get(term)
        return loaded_at is None or monotonic() - loaded_at >= self.reload_after_s

    async def get(
        self, connection: Any, term: int, field: int, version: tuple[int, ...], rescaling: Rescaling
    ) -> TermList:
        """``term``'s list at ``version``: the one kept, or read on ``connection`` (the snapshot that
        read ``version``). ``field``: the term's (a posting of another lexeme under the same hash is
        then rescaled as this field's, which only adds to the bounds of chunks not holding the term)."""
        if self.holds(term, version, rescaling):
            self._lists.move_to_end(term)
            return self._lists[term]
        loaded = await _load(connection, term, field, version, rescaling)
        self.loaded += 1
        now = monotonic()
        self._loaded_at = {key: at for key, at in self._loaded_at.items() if now - at < self.reload_after_s}
        self._loaded_at[term] = now
        KEYWORD_LISTS_LOADED.inc()
        replaced = self._lists.pop(term, None)  # read again: another search may have loaded it meanwhile
        if replaced is not None:
            self._forget(replaced)
        self._lists[term] = loaded
        self._used += loaded.nbytes
        KEYWORD_LISTS_BYTES.inc(loaded.nbytes)
        while self._used > self.budget_bytes and len(self._lists) > 1:
            self._forget(self._lists.popitem(last=False)[1])
        return loaded

    def _forget(self, dropped: TermList) -> None:
        self._used -= dropped.nbytes
        KEYWORD_LISTS_BYTES.dec(dropped.nbytes)


async def _load(connection: Any, term: int, field: int, version: tuple[int, ...], rescaling: Rescaling) -> TermList:
    """The term's postings by COPY in binary, from the index alone: about 0.2 µs a posting."""
    received = bytearray()

    async def keep(data: bytes) -> None:
        received.extend(data)

    await connection.copy_from_query(_POSTINGS, term, output=keep, format="binary")
    if not received.startswith(_SIGNATURE):
        raise ValueError("COPY answered without the binary signature")
    extension = int.from_bytes(received[15:19], "big")
    body = memoryview(received)[19 + extension : len(received) - 2]  # the trailer: a field count of -1
    rows = np.frombuffer(body, dtype=_ROW)
    keys = rows["key"].astype(np.int64)
    parts = rescaling.parts(rows["impact"].astype(np.float32), field)
    low, high = (int(keys.min()), int(keys.max())) if len(keys) else (0, 0)
    return TermList(version, rescaling, keys, parts, low, high)
