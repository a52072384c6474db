"""What ingest would embed for a documentation corpus, without embedding it: pages parsed and chunked
with the default settings, the texts built as the embed stage builds them.

    .venv/bin/python -m bench.clean_text [--corpus postgresql-doc-15] [--limit N]

Printed: pages, chunks, characters embedded, chunks without a heading, and what should not be in an
embedded text: Markdown link targets (``](``), URLs (``http``), DocBook navigation words (a line
``Prev``/``Next``/``Home``/``Up`` cells) and ``<?xml``. Cheap (seconds per thousand pages), so it
compares two versions of the parser quickly; ``bench.ingest`` measures what the change does to search.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.ingest import prepare_corpus  # noqa: E402
from ragstream.chunking import MarkdownChunker  # noqa: E402
from ragstream.parsing import Parser  # noqa: E402
from ragstream.settings import ChunkingSettings  # noqa: E402
from ragstream.stages.embed import embedding_input  # noqa: E402

_NAVIGATION = re.compile(r"\b(?:Prev|Next|Home|Up)\b.*\|.*\b(?:Prev|Next|Home|Up)\b")


def measure(folder: Path) -> dict[str, int]:
    settings = ChunkingSettings()
    chunker = MarkdownChunker(settings.size, settings.overlap)
    parser = Parser()
    totals = {"pages": 0, "chunks": 0, "characters_embedded": 0, "chunks_without_heading": 0}
    noise = {"link_targets": 0, "urls": 0, "navigation_lines": 0, "xml_declarations": 0}
    for page in sorted(folder.rglob("*.html")):
        parsed = parser.run(page.read_bytes(), "text/html", page.stem)
        chunks = chunker.run(parsed)
        totals["pages"] += 1
        totals["chunks"] += len(chunks)
        for chunk in chunks:
            text = embedding_input(parsed.title, chunk.heading, chunk.text)
            totals["characters_embedded"] += len(text)
            totals["chunks_without_heading"] += not chunk.heading
            noise["link_targets"] += text.count("](")
            noise["urls"] += text.count("http")
            noise["navigation_lines"] += sum(bool(_NAVIGATION.search(line)) for line in text.split("\n"))
            noise["xml_declarations"] += text.count("<?xml")
    return totals | noise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default="postgresql-doc-15")
    parser.add_argument("--limit", type=int, default=None)
    args = parser.parse_args()
    corpus = prepare_corpus(args.corpus, args.limit)
    print(json.dumps(measure(corpus.folder) | {"load1": round(os.getloadavg()[0], 2)}))


if __name__ == "__main__":
    main()
