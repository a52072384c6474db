"""Chunkers (markdown, token, recursive, semantic), their per-connection config and the factory.

Every chunker keeps the heading path of the section a chunk starts in, and no chunk it emits is
longer than its size ("oversize chunks are re-split before embedding").
"""

from __future__ import annotations

from ragstream.chunking.base import Chunker
from ragstream.chunking.config import (
    ChunkingConfig,
    MarkdownChunking,
    RecursiveChunking,
    SemanticChunking,
    TokenChunking,
    create_chunker,
    parse_chunking,
)
from ragstream.chunking.markdown import MarkdownChunker
from ragstream.chunking.recursive import RecursiveChunker
from ragstream.chunking.semantic import SemanticChunker
from ragstream.chunking.token import EstimatedTokenizer, TokenChunker, Tokenizer, tokenizer_for

__all__ = [
    "Chunker",
    "ChunkingConfig",
    "EstimatedTokenizer",
    "MarkdownChunker",
    "MarkdownChunking",
    "RecursiveChunker",
    "RecursiveChunking",
    "SemanticChunker",
    "SemanticChunking",
    "TokenChunker",
    "TokenChunking",
    "Tokenizer",
    "create_chunker",
    "parse_chunking",
    "tokenizer_for",
]
