"""Sharded results, written together: one transaction for the results of every shard a
member leads, not one per shard.

With one leader, a tick's runs are one batch, whose results are written every
``RESULT_FLUSH_INTERVAL``. A sharded member starts a batch per shard (each is its shard's
work: handing a shard over waits for its batch, results written, and losing it stops only
its runs). Written one by one, those batches' writes cost a commit each: measured, 1.11
commits per run at 64 shards against 0.33 with one leader (when they also queued on the
member's lock connection, a member was slower than one leader). So batches hand their
results here and wait for them to be written: whatever arrived while the last write was
in flight goes in the next one (group commit), in one fenced transaction scoped to the
shards those results belong to. A shard found lost by the fence gets its results back
unwritten (its runs stay ``running`` for the shard's next owner to close), as its own
write would have.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

from ..db.plugin_store import FinishedSchedule, PluginStore
from ..leadership import LeadershipLost, Lease, WriteGroup

T = TypeVar("T")

# What writes a list of results in a transaction, and says what it finished.
Write = Callable[[PluginStore, Sequence[T]], Awaitable[list[FinishedSchedule]]]
# A batch's results waiting to be written: its shard's lease, the results, the answer.
Pending = tuple[Lease, list[T], asyncio.Future[list[FinishedSchedule]]]


class SharedResults(Generic[T]):
    def __init__(self, write: Write[T], result_name: Callable[[T], str]) -> None:
        self._write = write
        self._name = result_name
        self._pending: list[Pending[T]] = []
        self._writer: asyncio.Task[None] | None = None

    async def write(
        self, lease: Lease, group: WriteGroup, ended: list[T]
    ) -> list[FinishedSchedule]:
        """Write ``ended`` (results of the runs of ``lease``, a shard's, one of ``group``)
        with whatever else is waiting; the schedules it finished. Raises
        :class:`LeadershipLost` if the shard was lost first (nothing of it written), or
        the write's own error."""
        done: asyncio.Future[list[FinishedSchedule]] = asyncio.get_running_loop().create_future()
        self._pending.append((lease, ended, done))
        if self._writer is None or self._writer.done():
            # The group's work: stopped with it, and the batches waiting then fail.
            self._writer = group.spawn(self._drain(group), name="plugin:results")
        return await done

    async def _drain(self, group: WriteGroup) -> None:
        batch: list[Pending[T]] = []
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                await self._write_batch(group, batch)
        finally:
            # Stopped with the member: no batch waits for ever on a write that will not be.
            for _, _, done in [*batch, *self._pending]:
                if not done.done():
                    done.set_exception(LeadershipLost("the member stopped before writing"))
            self._pending = []

    async def _write_batch(self, group: WriteGroup, batch: list[Pending[T]]) -> None:
        leases = {lease for lease, _, _ in batch}
        try:
            async with group.fenced_together(leases) as tx:
                live = set(tx.shards.tokens) if tx.shards is not None else set()
                written = [item for item in batch if item[0].shard in live]
                results = [result for _, ended, _ in written for result in ended]
                finished = await self._write(PluginStore(tx), results) if results else []
        except Exception as exc:
            for _, _, done in batch:
                if not done.done():
                    done.set_exception(exc)
            return
        by_name = {schedule.name: schedule for schedule in finished}
        for lease, ended, done in batch:
            if done.done():
                continue  # its batch was cancelled meanwhile
            if lease.shard not in live:
                done.set_exception(LeadershipLost(lease.reason or "its shard was lost"))
                continue
            mine = [by_name[name] for name in map(self._name, ended) if name in by_name]
            done.set_result(mine)
