"""Heading-aware chunking: headings first, then paragraphs, then sentences (Chinese included)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ragstream.chunking import MarkdownChunker
from ragstream.parsing import ParsedDocument


def chunk(markdown: str, size: int = 1500, overlap: int = 100) -> list[tuple[str, str]]:
    chunks = MarkdownChunker(size, overlap).run(ParsedDocument("t", markdown))
    assert [c.ordinal for c in chunks] == list(range(len(chunks)))
    return [(c.heading, c.text) for c in chunks]


def test_sections_that_fit_are_merged_and_keep_the_first_heading_path() -> None:
    chunks = chunk("# Guide\n\nIntro.\n\n## Install\n\nRun it.\n\n### Linux\n\napt install x\n")
    assert chunks == [("Guide", "# Guide\n\nIntro.\n\n## Install\n\nRun it.\n\n### Linux\n\napt install x")]


def test_large_sections_break_at_headings_with_their_paths() -> None:
    body = "A sentence that fills space. " * 40
    chunks = chunk(f"# Guide\n\n{body}\n\n## Install\n\n{body}\n\n### Linux\n\n{body}\n\n## Use\n\n{body}", size=1300)
    assert [heading for heading, _ in chunks] == ["Guide", "Guide > Install", "Guide > Install > Linux", "Guide > Use"]
    assert chunks[2][1].startswith("### Linux\n")


def test_a_long_chinese_paragraph_splits_at_sentence_ends_with_overlap() -> None:
    sentence = "值班工程师需要在十五分钟内响应告警并在群里同步进展。"
    chunks = chunk("# 值班\n\n" + sentence * 120, size=500, overlap=60)
    assert len(chunks) > 5
    assert all(len(text) <= 500 + len("# 值班\n") for _, text in chunks)
    assert all(text.endswith("。") for _, text in chunks)
    assert chunks[1][1][:20] in chunks[0][1]  # the overlap repeats the end of the previous chunk


def test_hashes_inside_code_fences_are_not_headings() -> None:
    chunks = chunk("# Ops\n\n```bash\n# restart the broker\nsystemctl restart kafka\n```\n")
    assert chunks == [("Ops", "# Ops\n\n```bash\n# restart the broker\nsystemctl restart kafka\n```")]


def test_deep_heading_paths_are_capped() -> None:
    markdown = "".join(f"{'#' * (1 + n % 6)} {'Heading' * 10} {n}\n\n{'text ' * 300}\n\n" for n in range(40))
    assert all(len(heading) <= 300 for heading, _ in chunk(markdown))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.sampled_from(["# A", "## B", "### C", "```", "", "。", "Sentence. ", "中文句子。"]),
            st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), max_size=400),
        ),
        max_size=60,
    )
)
def test_no_text_is_lost_and_no_chunk_exceeds_the_size(lines: list[str]) -> None:
    markdown = "\n".join(lines)
    chunks = chunk(markdown, size=300, overlap=30)
    joined = "".join(text for _, text in chunks)
    assert all(len(text) <= 300 + 2 * 300 for _, text in chunks)  # a lone heading line may be glued on
    for word in markdown.split():
        if not word.startswith("#"):
            assert word in joined or len(word) > 300


def test_text_before_the_first_heading_carries_the_page_title() -> None:
    intro = "The harbor gateway routes every request. " * 3
    chunks = MarkdownChunker(200, 0).run(ParsedDocument("Harbor guide", f"{intro}\n\n# Ports\n\n" + "Port 7411. " * 20))
    assert chunks[0].heading == "Harbor guide" and chunks[0].text.startswith("The harbor gateway")
    assert {chunk.heading for chunk in chunks[1:]} == {"Ports"}
