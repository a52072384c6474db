"""Request and response of a search: what callers send, and what a source card needs back."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from ragstream.core.storable import Storable, StorableStr

__all__ = [
    "ChatTurn",
    "DegradedPlatform",
    "MetadataValue",
    "Principal",
    "RephraseOutcome",
    "ResultMode",
    "SearchFilters",
    "SearchRequest",
    "SearchResponse",
    "SearchResult",
]

MetadataValue = StorableStr | int | float | bool

RephraseOutcome = Literal["original", "chitchat", "rephrased", "enriched"]
"""``original``: the raw question was searched (no rephraser, or it failed or changed nothing)."""

ResultMode = Literal["rag", "direct"]
"""``rag``: a chunk of the local index; ``direct``: a live hit of a platform's own search."""


class Principal(BaseModel):
    """Who is asking; a chunk whose ACL names none of these principals is invisible to them."""

    user: Annotated[str, Field(title="User id", min_length=1), Storable]
    groups: Annotated[list[StorableStr], Field(title="Group ids")] = []

    def principals(self) -> list[str]:
        return [f"user:{self.user}", *(f"group:{group}" for group in self.groups)]


class SearchFilters(BaseModel):
    """Scope of a search; every list given narrows it to its values (an empty one matches nothing), a
    missing one does not."""

    connection_ids: Annotated[list[StorableStr] | None, Field(title="Only these connections")] = None
    platforms: Annotated[
        list[StorableStr] | None, Field(title="Only these platforms", description="folder, feishu, ...")
    ] = None
    knowledge_bases: Annotated[list[StorableStr] | None, Field(title="Only these knowledge bases")] = None
    sources: Annotated[list[StorableStr] | None, Field(title="Only these sources", description="Paths or URLs.")] = None
    metadata: Annotated[
        dict[StorableStr, MetadataValue] | None,
        Field(title="Metadata that must match", description="All pairs must match."),
    ] = None


class ChatTurn(BaseModel):
    role: Literal["user", "assistant"]
    content: Annotated[str, Field(max_length=20_000), Storable]


class SearchRequest(BaseModel):
    query: Annotated[str, Field(title="Query", min_length=1, max_length=4000), Storable]
    top_k: Annotated[int, Field(title="Results to return", ge=1, le=30)] = 10
    filters: Annotated[SearchFilters, Field(title="Scope")] = SearchFilters()
    principal: Annotated[
        Principal | None, Field(title="Caller", description="Without one, only unrestricted chunks are visible.")
    ] = None
    conversation_id: Annotated[
        str | None,
        Field(title="Conversation", description="Keeps citation numbers stable across calls.", max_length=200),
        Storable,
    ] = None
    history: Annotated[
        list[ChatTurn], Field(title="Conversation so far", description="Used by the optional query rephraser.")
    ] = []
    user_context: Annotated[
        dict[Annotated[str, Field(max_length=64), Storable], Annotated[str, Field(max_length=500), Storable]],
        Field(
            title="Facts about the caller",
            description="Department, team, location…: the optional rephraser completes an incomplete question from "
            "them. Never used to filter.",
            max_length=20,
        ),
    ] = {}
    rephrase: Annotated[
        bool,
        Field(
            title="Let the rephraser run",
            description="False searches the query as it is (an agent that plans its own queries).",
        ),
    ] = True


class SearchResult(BaseModel):
    rank: Annotated[int, Field(title="1-based rank after fusion (and rerank)")]
    score: Annotated[float, Field(title="Fused score, or the reranker's relevance")]
    citation_index: Annotated[int, Field(title="Citation number", description="Same document, same number.")]
    document_id: str
    chunk_id: str
    connection_id: str
    platform: Annotated[str, Field(title="Platform of the connection")]
    knowledge_base: Annotated[str, Field(title="Knowledge base name")]
    title: str
    source: Annotated[str, Field(title="Source", description="Path relative to the folder root, or the URL.")]
    url: Annotated[str | None, Field(title="Link to the original")] = None
    heading: Annotated[str, Field(title="Heading path of the chunk")]
    text: Annotated[str, Field(title="Chunk text, cut to the context budget")]
    preview: Annotated[str, Field(title="Matching paragraph preview", description="For source cards.")]
    vector_rank: Annotated[int | None, Field(title="Rank in the vector leg")] = None
    keyword_rank: Annotated[int | None, Field(title="Rank in the keyword leg")] = None
    embedding_space: Annotated[
        str | None,
        Field(
            title="Embedding space of the chunk's connection",
            description="The model key its vector leg searched: the connection's own model, else the default.",
        ),
    ] = None
    mode: Annotated[
        ResultMode,
        Field(
            title="Where the result comes from", description="rag: the local index; direct: a platform's live search."
        ),
    ] = "rag"


class DegradedPlatform(BaseModel):
    """A direct-search connection whose live results are missing from this response, and why."""

    connection_id: str
    platform: str
    reason: Annotated[str, Field(title="Why", description="A timeout or the platform's error, without secrets.")]


class SearchResponse(BaseModel):
    query: str
    rewritten_query: Annotated[str | None, Field(title="Standalone question the rephraser produced")] = None
    rephrase_outcome: Annotated[
        RephraseOutcome,
        Field(
            title="What the rephraser decided",
            description="original: the query was searched as sent; rephrased: made standalone from the history; "
            "enriched: completed from user_context; chitchat: answered by `reply`, nothing searched.",
        ),
    ] = "original"
    reply: Annotated[
        str | None, Field(title="Direct reply to chit-chat", description="Set only when rephrase_outcome is chitchat.")
    ] = None
    results: list[SearchResult]
    reranked: Annotated[bool, Field(title="Whether a reranker ordered the results")] = False
    embedding_space: Annotated[
        str | None,
        Field(
            title="Embedding space of the vector leg",
            description="Its model key (the default space's when several were searched); none when nothing is "
            "embedded.",
        ),
    ] = None
    embedding_spaces: Annotated[
        list[str],
        Field(
            title="Embedding spaces searched",
            description="One vector leg per model of the connections in scope (each its own connections), "
            "the default space first.",
        ),
    ] = []
    degraded: Annotated[
        list[DegradedPlatform],
        Field(title="Direct-search connections left out", description="Slow or failing: the search went on without."),
    ] = []
    took_ms: float
