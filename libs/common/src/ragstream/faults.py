"""Named crash points for fault-injection tests: a no-op unless the environment arms one.

``RAGSTREAM_CRASH_AT=indexer.after_publish`` with ``RAGSTREAM_CRASH_AFTER=3`` kills the process the
third time that point is reached, exactly where a real crash would lose an uncommitted offset.
"""

from __future__ import annotations

import os

__all__ = ["crash_point"]

_hits: dict[str, int] = {}


def crash_point(name: str) -> None:
    if os.environ.get("RAGSTREAM_CRASH_AT") != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] >= int(os.environ.get("RAGSTREAM_CRASH_AFTER", "1")):
        os._exit(86)  # no cleanup, no offset commit: the point of the exercise
