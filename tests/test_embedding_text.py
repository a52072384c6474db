"""What a chunk is embedded from: its text under the page title and heading path, the title said once."""

from __future__ import annotations

import pytest

from ragstream.stages.embed import embedding_input


@pytest.mark.parametrize(
    ("title", "heading", "expected"),
    [
        ("CREATE TABLE", "CREATE TABLE", "CREATE TABLE\nbody"),
        ("CREATE TABLE", "CREATE TABLE > Synopsis", "CREATE TABLE > Synopsis\nbody"),
        ("Harbor guide", "Ports", "Harbor guide > Ports\nbody"),
        ("Harbor", "Harbor ports", "Harbor > Harbor ports\nbody"),
        ("", "Ports", "Ports\nbody"),
        ("Harbor guide", "", "Harbor guide\nbody"),
        ("", "", "body"),
    ],
)
def test_the_title_is_not_repeated_by_a_heading_path_that_starts_with_it(
    title: str, heading: str, expected: str
) -> None:
    assert embedding_input(title, heading, "body") == expected
