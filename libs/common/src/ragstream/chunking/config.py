"""Chunking configuration: one variant per algorithm, told apart by ``kind``, each building its chunker.

Stored per connection in ``connections.config`` under ``"chunking"``, for example::

    {"chunking": {"kind": "token", "size": 512, "overlap": 0}}
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from ragstream.chunking.markdown import MarkdownChunker
from ragstream.chunking.recursive import RecursiveChunker
from ragstream.chunking.semantic import DEFAULT_AMOUNTS, SemanticChunker, ThresholdType
from ragstream.chunking.token import TokenChunker, tokenizer_for

if TYPE_CHECKING:
    from ragstream.chunking.base import Chunker
    from ragstream.embedding.base import Embedder

__all__ = [
    "ChunkingConfig",
    "MarkdownChunking",
    "RecursiveChunking",
    "SemanticChunking",
    "TokenChunking",
    "create_chunker",
    "parse_chunking",
]


class _Variant(BaseModel):
    # Frozen, so a config is hashable and the chunk stage can keep one chunker per config.
    model_config = ConfigDict(extra="forbid", frozen=True)

    size: int
    overlap: int = 0

    @model_validator(mode="after")
    def _overlap_below_size(self) -> _Variant:
        if self.overlap >= self.size:
            raise ValueError("overlap must be smaller than size")
        return self


class MarkdownChunking(_Variant):
    """Headings first: sections merged up to ``size`` characters, long ones split at paragraphs, then sentences."""

    kind: Annotated[Literal["markdown"], Field(title="Algorithm")] = "markdown"
    size: Annotated[int, Field(title="Max chunk size", description="In characters.", ge=100, le=100_000)] = 1500
    overlap: Annotated[int, Field(title="Overlap", description="Characters shared by neighbours.", ge=0)] = 100

    def create(self, embedder: Embedder) -> Chunker:
        return MarkdownChunker(self.size, self.overlap)


class TokenChunking(_Variant):
    """Headings first like ``markdown``, measured in tokens of the embedding model (the spec's default splitter)."""

    kind: Annotated[Literal["token"], Field(title="Algorithm")] = "token"
    size: Annotated[
        int, Field(title="Max chunk size", description="In tokens of the embedding model.", ge=16, le=8192)
    ] = 512
    overlap: Annotated[int, Field(title="Overlap", description="Tokens shared by neighbours.", ge=0)] = 0

    def create(self, embedder: Embedder) -> Chunker:
        return TokenChunker(self.size, self.overlap, tokenizer_for(embedder))


class RecursiveChunking(_Variant):
    """Size first: the whole text cut at paragraph, line, sentence, word breaks, across headings."""

    kind: Annotated[Literal["recursive"], Field(title="Algorithm")] = "recursive"
    size: Annotated[int, Field(title="Max chunk size", description="In characters.", ge=100, le=100_000)] = 1500
    overlap: Annotated[int, Field(title="Overlap", description="Characters shared by neighbours.", ge=0)] = 100

    def create(self, embedder: Embedder) -> Chunker:
        return RecursiveChunker(self.size, self.overlap)


class SemanticChunking(_Variant):
    """Breaks where the meaning of neighbouring sentences shifts; pieces over ``size`` tokens are split again."""

    kind: Annotated[Literal["semantic"], Field(title="Algorithm")] = "semantic"
    threshold_type: Annotated[
        ThresholdType,
        Field(title="Threshold type", description="percentile, std (standard deviation), iqr or gradient."),
    ] = "percentile"
    threshold_amount: Annotated[
        float | None,
        Field(
            title="Threshold amount",
            description="Percentile (0-100) for percentile and gradient, a multiplier for std and iqr. "
            "Unset: 95, 3, 1.5, 95.",
            ge=0,
        ),
    ] = None
    size: Annotated[
        int, Field(title="Max chunk size", description="In tokens of the embedding model.", ge=16, le=8192)
    ] = 512
    overlap: Annotated[Literal[0], Field(title="Overlap", description="Semantic chunks do not overlap.")] = 0

    @model_validator(mode="after")
    def _percentile_range(self) -> SemanticChunking:
        if self.threshold_type in ("percentile", "gradient") and (self.threshold_amount or 0) > 100:
            raise ValueError(f"a {self.threshold_type} threshold_amount is a percentile: at most 100")
        return self

    @property
    def amount(self) -> float:
        return DEFAULT_AMOUNTS[self.threshold_type] if self.threshold_amount is None else self.threshold_amount

    def create(self, embedder: Embedder) -> Chunker:
        return SemanticChunker(embedder, self.threshold_type, self.amount, self.size, tokenizer_for(embedder))


ChunkingConfig = Annotated[
    MarkdownChunking | TokenChunking | RecursiveChunking | SemanticChunking, Field(discriminator="kind")
]
"""How one connection's documents are chunked; ``kind`` picks the variant."""

_ADAPTER: TypeAdapter[ChunkingConfig] = TypeAdapter(ChunkingConfig)


def parse_chunking(data: Any) -> ChunkingConfig:
    """Validate a stored or user-given config (a dict or JSON text); raises pydantic's ``ValidationError``."""
    return _ADAPTER.validate_json(data) if isinstance(data, str | bytes) else _ADAPTER.validate_python(data)


def create_chunker(config: ChunkingConfig, embedder: Embedder) -> Chunker:
    """Build the chunker of ``config``; ``embedder`` supplies the tokenizer and the semantic vectors."""
    return config.create(embedder)
