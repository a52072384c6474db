"""Keeps the embedded PostgreSQL of ``ragstream up`` running: starts it again when it dies."""

from __future__ import annotations

import asyncio
import logging

from ragstream.storage.embedded_postgres import EmbeddedPostgres, EmbeddedPostgresError

__all__ = ["EmbeddedSupervisor"]

logger = logging.getLogger(__name__)


class EmbeddedSupervisor:
    """Watches the postmaster of a started ``EmbeddedPostgres`` and restarts it on the same port, so
    the pool's DSN stays valid (asyncpg pools replace closed connections on acquire). Meanwhile
    ``down`` says why the database is unavailable; readiness reports it."""

    def __init__(self, server: EmbeddedPostgres, *, interval_s: float = 0.5, retry_s: float = 2.0) -> None:
        self._server = server
        self._interval_s = interval_s
        self._retry_s = retry_s
        self.down: str | None = None

    async def run(self) -> None:
        """Watch until cancelled."""
        while True:
            await asyncio.sleep(self._interval_s)
            if self._server.alive():
                continue
            self.down = "the embedded PostgreSQL stopped: restarting it"
            logger.warning("%s (%s)", self.down, self._server.data_dir)
            await self._restart()
            logger.warning("the embedded PostgreSQL runs again")
            self.down = None

    async def _restart(self) -> None:
        while True:
            try:
                # In a thread: a start waits for the server (and for the start lock of the data dir).
                await asyncio.to_thread(self._server.restart)
                return
            except EmbeddedPostgresError as error:
                first_line = str(error).splitlines()[0]
                self.down = f"the embedded PostgreSQL stopped and does not start again: {first_line}"
                logger.warning("%s; retrying in %.0f s", self.down, self._retry_s, exc_info=True)
            await asyncio.sleep(self._retry_s)
