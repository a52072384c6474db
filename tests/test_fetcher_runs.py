"""The connector-fetcher's own sync runs, in process on real PostgreSQL and Kafka: a run failed
elsewhere while the fetcher walks stops the walk, so it never moves a cursor a replacement resumes."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import ClassVar

import httpx
import pytest

from ragstream.connectors import registry
from ragstream.connectors.base import SourceItem
from ragstream.connectors.folder import FolderConnector
from ragstream_fetcher import main as fetcher_main
from tests.support.connections import fetcher_database
from tests.support.run_owner import owner_locks

pytestmark = [pytest.mark.integration, pytest.mark.kafka, pytest.mark.usefixtures("folder_roots")]

FILES = 40


class SlowFolder(FolderConnector):
    """A folder whose downloads take a while, like a remote platform's; it records them."""

    downloaded: ClassVar[list[str]] = []

    async def fetch(self, item: SourceItem) -> bytes:
        await asyncio.sleep(0.05)
        SlowFolder.downloaded.append(item.external_id)
        return await super().fetch(item)


async def test_a_run_failed_elsewhere_stops_the_fetchers_walk(
    database_url: str, kafka_bootstrap: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "kb"
    folder.mkdir()
    for index in range(FILES):
        (folder / f"doc-{index:02}.md").write_text(f"# Doc {index}\n\nA slow page number {index}.\n")
    monkeypatch.setattr(registry, "FolderConnector", SlowFolder)
    monkeypatch.setattr(SlowFolder, "downloaded", [])
    async with fetcher_database(
        database_url, kafka_bootstrap, monkeypatch, scheduler_enabled="false", sync_progress_interval_s="0.05"
    ) as pool:
        app = fetcher_main.create_app()
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client,
        ):
            started = (await client.post("/v1/syncs", json={"path": str(folder)})).json()
            connection_id = started["connection_id"]
            deadline = time.monotonic() + 30
            while len(SlowFolder.downloaded) < 5:
                assert time.monotonic() < deadline, "the walk did not start"
                await asyncio.sleep(0.02)
            # Another replica fails the run (as stale); a replacement may now resume its walk.
            run_id = await pool.fetchval(
                "UPDATE runs SET status = 'failed', error = 'stale: no progress for 1800 s',"
                " finished_at = now() WHERE connection_id = $1 AND status = 'running' RETURNING id",
                connection_id,
            )
            # The fetcher lets go of the run's owner lock once it has stopped the walk.
            while await owner_locks(pool, run_id):
                assert time.monotonic() < deadline, "the fetcher kept walking a run failed elsewhere"
                await asyncio.sleep(0.02)
            sync = (await client.get(f"/v1/syncs/{connection_id}")).json()
            stopped_at = len(SlowFolder.downloaded)
            position = await pool.fetchval(
                "SELECT position FROM sync_cursors WHERE connection_id = $1 AND stage = 'download'", connection_id
            )
            await asyncio.sleep(0.3)
            assert (sync["state"], sync["error"]) == ("failed", "stale: no progress for 1800 s")
            assert stopped_at < FILES and len(SlowFolder.downloaded) == stopped_at
            assert position is not None and position < f"doc-{FILES - 1:02}.md"
            assert position == await pool.fetchval(
                "SELECT position FROM sync_cursors WHERE connection_id = $1 AND stage = 'download'", connection_id
            )
            assert await owner_locks(pool, run_id) == 0
