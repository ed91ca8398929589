"""What the plugin loop's leader writes before it claims: the deployment's declared tasks
brought in line with their rows, the targets runtime schedules may name, and the runs its
predecessors left ``running`` closed. loops/plugin.py calls these in a tick's transaction:
a leadership's first tick takes over; a tick for a shard newly held or with orphaned runs
(in transaction mode, every tick) abandons; a tick that found a declared task this
deployment does not declare declares."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..db.plugin_store import Declaration, PluginStore
from ..logs import Logger
from ..metrics import Metrics
from ..plugins.tasks import TaskSpec

ABANDONED = "abandoned: the replica running it lost the lock before it finished"


@dataclass(frozen=True, slots=True)
class Takeover:
    tasks: Mapping[str, TaskSpec]  # declared by the deployment, by name
    runnable: Iterable[str]  # what runtime schedules may name
    metrics: Metrics
    label: Callable[[str, TaskSpec | None], str]  # a run's metrics' ``task`` label

    async def take_over(self, store: PluginStore, log: Logger) -> None:
        """Bring declared tasks' rows in line with this deployment, keeping every known
        task's next_run_at (a restart must not reschedule), and publish what runtime
        schedules may name."""
        await self.declare(store, log)
        await store.publish_runnable(self.runnable)

    async def declare(self, store: PluginStore, log: Logger) -> None:
        now = await store.now()
        declared = [
            Declaration(spec.name, spec.schedule.describe(), spec.schedule.first(now), spec.source)
            for spec in self.tasks.values()
        ]
        for change in await store.declare(declared):
            spec = self.tasks.get(change.name)
            schedule = spec.schedule.describe() if spec is not None else None
            if change.change == "registered":
                log.info(
                    "task.registered", task=change.name, schedule=schedule,
                    source=spec.source if spec is not None else None,
                )  # fmt: skip
            elif change.change == "rescheduled":
                log.info("task.rescheduled", task=change.name, schedule=schedule)
            elif change.change == "shadowed":
                log.error(
                    "task.shadowed", task=change.name,
                    hint="a runtime schedule has this declared task's name: the runtime "
                    "schedule runs; remove it or rename the task",
                )  # fmt: skip

    async def abandon(self, store: PluginStore, log: Logger, keep: Sequence[int]) -> None:
        """Close the runs still ``running`` but ``keep``: this replica's own in flight,
        which will write their results (not its orphans, which never will)."""
        for run in await store.abandon(ABANDONED, keep):
            self.metrics.plugin_runs.labels(self.label(run.name, None), "abandoned").inc()
            log.warning(
                "task.abandoned", task=run.name, slot=run.slot.isoformat(),
                run_instance=run.instance,  # `instance` names the logger
            )  # fmt: skip
