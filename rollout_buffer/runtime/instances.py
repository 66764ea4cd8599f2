"""Who else is there: this instance's row in ``rollout_buffer_instances``, and the others of its
buffer.

Owns: writing this instance's row (role, URL, host, buffer, and ``report``: what the loop saw of a
launcher on this host), forgetting it on a stop, pruning rows not seen for INSTANCE_KEEP_S, and
reading a buffer's live instances (the owner hands its launcher to a standby on its host; an owner
asks the instances on a launcher's host what they saw). The lease's thread calls it with its own
connection. It must not decide who owns the job: lease.py does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rollout_buffer.storage import lease_sql as sql
from rollout_buffer.storage.db import Database

INSTANCE_KEEP_S = 600.0  # rows of instances not seen for this long are deleted
PRUNE_EVERY_S = 60.0
GONE = 1e18  # "not seen for this long" that every row matches: with an instance id, forget it


def live(db: Database, within_s: float, buffer: str = "") -> list[dict[str, Any]]:
    """A buffer's instances (owner and standbys) seen within the last seconds."""
    return db.fetchall(sql.INSTANCES_LIVE[db.backend], (within_s, buffer))


class Instances:
    """This instance's row, kept by the lease's thread."""

    def __init__(
        self,
        instance_id: str,
        host_id: str,
        url: str | None,
        buffer: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.instance_id = instance_id
        self.host_id = host_id
        self.url = url
        self.buffer = buffer
        self.clock = clock
        self._pruned_at = float("-inf")

    def seen(self, db: Database, role: str, report: str | None) -> None:
        """This instance is alive in this role; now and then, forget the rows of long-gone ones."""
        db.execute(
            sql.INSTANCE_SEEN[db.backend],
            (self.instance_id, self.host_id, self.url, role, report, self.buffer),
        )
        now = self.clock()
        if now - self._pruned_at > PRUNE_EVERY_S:
            self._pruned_at = now
            db.execute(sql.INSTANCES_PRUNE[db.backend], (INSTANCE_KEEP_S, ""))

    def leave(self, db: Database) -> None:
        """This instance stops (or stops counting as a standby): its row goes."""
        db.execute(sql.INSTANCES_PRUNE[db.backend], (GONE, self.instance_id))
