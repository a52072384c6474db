"""Word segmentation that makes Chinese searchable by words and keeps identifiers whole."""

from __future__ import annotations

import pytest

from ragstream.segmentation import query_terms, segment


def test_chinese_is_cut_into_words() -> None:
    assert segment("出差住宿标准").split() == ["出差", "住宿", "标准"]


def test_mixed_text_keeps_english_words_and_identifiers() -> None:
    words = segment("请查看PPR-9087和v1.2.3的发布说明 release notes").split()
    assert {"PPR-9087", "PPR9087", "v1.2.3", "release", "notes", "发布", "说明"} <= set(words)


@pytest.mark.parametrize(
    ("query", "terms"),
    [
        ("出差住宿标准是多少？", ["出差", "住宿", "标准"]),
        ("What's the on-call rotation?", ["what", "s", "the", "on-call", "oncall", "rotation"]),  # SQL drops stop words
        ("NW-SEC-042", ["nw-sec-042", "nwsec042"]),
        ("？？", []),
    ],
)
def test_query_terms_drop_function_words_and_punctuation(query: str, terms: list[str]) -> None:
    assert query_terms(query) == terms
