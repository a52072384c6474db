"""Word segmentation for the keyword index, so Chinese text is searchable by words.

PostgreSQL's parsers split on spaces and punctuation, which leaves a Chinese sentence as one huge
"word". jieba cuts it into words at index time and at query time, and the segmented text goes
through the ``english`` configuration so English words are stemmed as usual.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jieba import Tokenizer

__all__ = ["query_terms", "segment"]

_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
# Identifiers such as PPR-9087 or v1.2.3 stay whole, other words split on non-word characters.
_TOKEN = re.compile(r"[A-Za-z0-9]+(?:[-_.][A-Za-z0-9]+)*|[^\W\d_A-Za-z]+", re.UNICODE)
# Chinese function words and question words: the english configuration drops English stop words
# at query time, and these would otherwise match nearly every Chinese chunk.
_CJK_STOP_WORDS = frozenset("的了是在和与及或吗呢啊吧呀么我你他她它这那有也都就要会能") | frozenset(
    {"什么", "多少", "怎么", "怎样", "如何", "哪些", "哪个", "哪里", "为什么", "是否", "我们", "你们", "他们"}
    | {"这个", "那个", "可以", "一个", "请问"}
)
_tokenizer: Tokenizer | None = None
_lock = threading.Lock()


def _jieba() -> Tokenizer:
    global _tokenizer
    with _lock:
        if _tokenizer is None:
            # Imported lazily: jieba builds its prefix dictionary (about a second) on first use.
            import jieba

            jieba.setLogLevel(logging.WARNING)
            tokenizer = jieba.Tokenizer()
            tokenizer.initialize()
            _tokenizer = tokenizer
        return _tokenizer


def _words(text: str) -> list[str]:
    words: list[str] = []
    for token in _TOKEN.findall(text):
        if _CJK.search(token):
            words.extend(w for w in _jieba().cut_for_search(token) if w.strip())
        else:
            words.append(token)
    return words


def segment(text: str) -> str:
    """Text with words separated by spaces, ready for ``to_tsvector('english', ...)``.

    Identifiers with inner hyphens or dots are also emitted whole with the separators replaced,
    because PostgreSQL's parser would otherwise split ``PPR-9087`` into ``ppr`` and ``-9087``.
    """
    out: list[str] = []
    for word in _words(text):
        out.append(word)
        if re.search(r"[-_.]", word):
            out.append(re.sub(r"[-_.]", "", word))
    return " ".join(out)


def query_terms(query: str) -> list[str]:
    """Distinct lower-cased search terms of a query, in order, each safe to quote in a tsquery."""
    seen: dict[str, None] = {}
    for word in segment(query).split():
        term = word.lower().replace("'", "")
        if term and term not in _CJK_STOP_WORDS:
            seen.setdefault(term, None)
    return list(seen)
