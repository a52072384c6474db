"""What a platform's live search answers, and the shape every platform searcher has."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["LiveHit", "PlatformSearcher"]


@dataclass(frozen=True, slots=True)
class LiveHit:
    """One hit of a platform search, best first in its list. ``text`` is what the platform gave
    (a summary, the first paragraphs), never a whole document; ``acl`` as on a chunk (None: everyone
    who can see the connection)."""

    external_id: str
    title: str
    text: str
    knowledge_base: str
    url: str | None = None
    acl: tuple[str, ...] | None = None


class PlatformSearcher(Protocol):
    """One connection's live search; its HTTP pool lives until ``aclose``."""

    async def search(self, query: str, wanted: int) -> list[LiveHit]: ...

    async def aclose(self) -> None: ...
