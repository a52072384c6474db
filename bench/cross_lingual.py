"""Same-language and cross-lingual search on the bundled knowledge base, for a space and its fusions.

    .venv/bin/python -m bench.cross_lingual --provider bilingual-pair --fusions '[{"kind": "rrf", "k": 10}]'

Syncs ``examples/knowledge-base`` (18 English and 18 Chinese pages) into a private embedded PostgreSQL
with the given embedding provider, then, for each fusion in turn (set as the space's own, as ``PUT
/v1/spaces/{model_key}/fusion`` does), runs the 30 sample queries (``examples/sample-queries.jsonl``,
each in its page's language) and the 26 cross-lingual ones (``examples/cross-lingual-queries.jsonl``: a
Chinese question for an English page, an English one for a Chinese page) and prints, per group, how
many found their page among the 10 results and how many at rank 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from ragstream.connectors.folder import FolderConnector
from ragstream.retrieval import SearchFilters, SearchRequest
from ragstream.runtime import open_runtime
from ragstream.settings import EmbeddingSettings, Settings
from ragstream.storage.embedded_postgres import EmbeddedPostgres
from ragstream.storage.spaces import SpaceStore

__all__ = ["main"]

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def queries(name: str) -> list[dict[str, str]]:
    return [json.loads(line) for line in (EXAMPLES / name).read_text().splitlines() if line.strip()]


def group(query: dict[str, str], cross: bool) -> str:
    language = query["expected_source"][:2]
    if not cross:
        return f"same language ({language})"
    return "zh question, en page" if language == "en" else "en question, zh page"


async def measure(dsn: str, provider: str, fusions: list[dict[str, object]]) -> None:
    settings = Settings(embedding=EmbeddingSettings(provider=provider))  # type: ignore[arg-type]
    async with open_runtime(settings, dsn) as runtime:
        connector = FolderConnector(EXAMPLES / "knowledge-base")
        report = await runtime.pipeline().sync(connector)
        assert report.ok, report.failures
        spaces = SpaceStore(runtime.pool)
        model_key = (await spaces.active()).model_key  # type: ignore[union-attr]
        asked = [(query, False) for query in queries("sample-queries.jsonl")]
        asked += [(query, True) for query in queries("cross-lingual-queries.jsonl")]
        for fusion in fusions:
            await spaces.set_fusion(model_key, fusion)
            runtime.spaces.invalidate()
            counts: dict[str, list[int]] = {}
            for query, cross in asked:
                request = SearchRequest(
                    query=query["query"], top_k=10, filters=SearchFilters(connection_ids=[connector.connection_id])
                )
                pages = list(
                    dict.fromkeys(result.source for result in (await runtime.retriever.search(request)).results)
                )
                found = counts.setdefault(group(query, cross), [0, 0, 0])
                found[0] += 1
                found[1] += query["expected_source"] in pages
                found[2] += pages[:1] == [query["expected_source"]]
            figures = "; ".join(
                f"{name}: {top10}/{total} in the top 10, {first} first"
                for name, (total, top10, first) in counts.items()
            )
            print(f"{provider} {json.dumps(fusion)}: {figures}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--provider", default="bilingual-pair", help="the embedding provider (RAGSTREAM_EMBEDDER_PROVIDER)"
    )
    parser.add_argument("--fusions", required=True, help="a JSON list of fusions, as PUT /v1/spaces/.../fusion takes")
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="ragstream-cross-lingual-") as folder,
        EmbeddedPostgres(Path(folder)) as server,
    ):
        asyncio.run(measure(server.dsn, args.provider, json.loads(args.fusions)))


if __name__ == "__main__":
    main()
