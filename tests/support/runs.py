"""A runner that knows only the sync kind, as most sync tests need."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ragstream.control.kinds import sync_kind
from ragstream.control.runner import Runner
from ragstream.jobs.sync import SyncJob
from ragstream.storage.runs import RunStore

__all__ = ["sync_runner"]


def sync_runner(runs: RunStore, job: Callable[[], SyncJob], **options: Any) -> Runner:
    """``Runner`` with the one kind ``sync``, running ``job`` (options as for ``Runner``)."""
    return Runner(runs, {"sync": sync_kind(runs, job)}, **options)
