"""GET /metrics: the service's counters and gauges in Prometheus text exposition format (0.0.4).

The active job is the label ``job_session``, never ``job``: Prometheus attaches its own ``job`` (the
scrape job) and ``instance`` labels, and renames a scraped ``job`` to ``exported_job``, so a
dashboard selecting by ``job`` would select by the scrape job instead.

Owns: the exposition text of what the service reports. It must not compute figures of its own or
open a database connection (it renders ``service.stats`` without one).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from rollout_buffer.core.salvage import REASONS as SALVAGE_REASONS

if TYPE_CHECKING:  # pragma: no cover
    from rollout_buffer.service import Service

PREFIX = "rollout_buffer_"


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt(value: float) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float) and math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if isinstance(value, float) else str(int(value))


class _Out:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def metric(
        self, name: str, kind: str, help_: str, samples: Iterable[tuple[dict[str, Any], float]]
    ) -> None:
        full = PREFIX + name
        self.lines.append(f"# HELP {full} {help_}")
        self.lines.append(f"# TYPE {full} {kind}")
        for labels, value in samples:
            self.sample(full, labels, value)

    def sample(self, full: str, labels: dict[str, Any], value: float) -> None:
        text = ",".join(f'{name}="{_escape(label)}"' for name, label in labels.items())
        self.lines.append(f"{full}{{{text}}} {_fmt(value)}" if text else f"{full} {_fmt(value)}")


def _gate(out: _Out, admission: dict[str, Any]) -> None:
    """The pacing gate's refusals and held calls (nothing when pacing is off)."""
    if "refused" not in admission:
        return
    out.metric(
        "gate_refused_total",
        "counter",
        "Requests the pacing gate refused or closed, by reason.",
        [({"reason": reason}, count) for reason, count in sorted(admission["refused"].items())],
    )
    out.metric(
        "gate_held_calls",
        "gauge",
        "First model calls the pacing gate holds now.",
        [({}, admission["gate"]["held_calls"])],
    )


def _waste(out: _Out, job: str, waste: dict[str, Any] | None) -> None:
    """What generating the groups cost, served against discarded by reason (issue 23)."""
    if not waste:
        return
    outcomes = [("served", "", waste["served"])] + [
        ("discarded", r, g) for r, g in sorted(waste["discarded_by_reason"].items())
    ]
    for key, name, help_ in (
        ("generation_s", "generation_seconds_total", "Sessions' generation seconds of the groups"),
        ("groups", "generated_groups_total", "Groups generated"),
        ("rows", "generated_rows_total", "Rows of the generated groups"),
    ):
        out.metric(
            name,
            "counter",
            f"{help_}, served or discarded (by reason): the waste.",
            [({"job_session": job, "outcome": o, "reason": r}, g[key]) for o, r, g in outcomes],
        )
    out.metric(
        "discarded_generation_share",
        "gauge",
        "Share of the generation seconds that went to discarded groups.",
        [({"job_session": job}, waste["discarded_share"]["generation_s"])],
    )


def _salvaged(out: _Out, job: str, salvaged: dict[str, Any]) -> None:
    """Sessions and groups served truncated (issue 38), by reason (every reason, 0 included)."""
    for kind in ("sessions", "groups"):
        counts = salvaged[kind]
        out.metric(
            f"{kind}_salvaged_total",
            "counter",
            f"{kind.capitalize()} served with truncated sessions (ROLLOUT_BUFFER_SALVAGE), by "
            "reason.",
            [
                ({"job_session": job, "reason": reason}, counts.get(reason, 0))
                for reason in sorted(set(SALVAGE_REASONS) | set(counts))
            ],
        )


def render_metrics(service: Service) -> str:
    """The exposition text."""
    stats = service.stats(None)
    out = _Out()
    job = stats.get("job_session") or ""
    launcher = stats["launcher"]
    notif = stats["proxy_notifications"]
    rows = stats.get("rows")
    if rows is not None:
        labels = {"job_session": job}
        out.metric(
            "rows_read_total",
            "counter",
            "Distinct trainable rows read for the active job.",
            [(labels, rows["read"])],
        )
        out.metric(
            "rows_served_total",
            "counter",
            "Rows served to the trainer.",
            [(labels, rows["served"])],
        )
        out.metric(
            "rows_dropped_total",
            "counter",
            "Rows dropped, by reason.",
            [
                ({"job_session": job, "reason": reason}, count)
                for reason, count in sorted(rows["dropped"].items())
            ],
        )
        out.metric(
            "rows_rejected_total",
            "counter",
            "Rows that could not become items, by reason.",
            [
                ({"job_session": job, "reason": reason}, count)
                for reason, count in sorted(rows["rejected"].items())
            ],
        )
        out.metric(
            "rows_pending", "gauge", "Rows of undecided groups.", [(labels, rows["pending"])]
        )
        groups = stats["groups"]
        out.metric(
            "groups",
            "gauge",
            "Undecided groups by state.",
            [
                ({"job_session": job, "state": state}, groups[state])
                for state in ("pending", "ready", "in_flight")
            ],
        )
        out.metric("groups_served_total", "counter", "Groups served.", [(labels, groups["served"])])
        out.metric(
            "groups_partial_total",
            "counter",
            "Groups served short of K (ROLLOUT_BUFFER_MIN_GROUP_SIZE); also in groups_served.",
            [(labels, groups["partial"])],
        )
        out.metric(
            "groups_dropped_total",
            "counter",
            "Groups dropped, by reason.",
            [
                ({"job_session": job, "reason": reason}, count)
                for reason, count in sorted(groups["dropped"].items())
            ],
        )
        out.metric(
            "cursor",
            "gauge",
            "Ingest cursor (all rows at or below it are read).",
            [(labels, stats["cursor"])],
        )
        age = stats.get("oldest_pending_group_age_s")
        out.metric(
            "oldest_pending_group_age_seconds",
            "gauge",
            "Age of the oldest undecided group.",
            [(labels, age or 0.0)],
        )
        figures = [
            ("served", "", stats["figures"]["served"]),
            *(
                ("dropped", reason, figure)
                for reason, figure in stats["figures"]["dropped"].items()
            ),
        ]
        for key, name, help_ in (
            ("steps_per_session", "group_steps_per_session", "Mean steps per session"),
            ("terminal_reward_mean", "group_terminal_reward_mean", "Mean terminal reward"),
        ):
            out.metric(
                name,
                "gauge",
                f"{help_} of the served and the dropped groups (by reason): drop bias.",
                [
                    ({"job_session": job, "outcome": outcome, "reason": reason}, figure[key])
                    for outcome, reason, figure in figures
                    if figure[key] is not None
                ],
            )
        _waste(out, job, stats.get("waste"))
        _salvaged(out, job, stats["salvaged"])
        redelivery = stats["redelivery"]
        out.metric(
            "redelivery_queued",
            "gauge",
            "Served groups queued to be delivered again (a trainer crash).",
            [(labels, redelivery["queued"])],
        )
        out.metric(
            "redeliveries_total",
            "counter",
            "Served groups asked for again, by what became of them.",
            [
                ({"job_session": job, "outcome": outcome}, redelivery[outcome])
                for outcome in ("requested", "delivered", "cancelled", "failed")
            ],
        )
        versions = stats["versions"]
        out.metric(
            "weight_version",
            "gauge",
            "The job's current version, the trainer's last and the rows' largest.",
            [
                ({"job_session": job, "kind": kind}, versions[kind])
                for kind in ("current", "trainer", "rows")
                if versions[kind] is not None
            ],
        )
    # one snapshot of the poll figures: the histogram's buckets, sum and count agree
    polls = service.serving.stats.snapshot()
    out.metric(
        "polls_total", "counter", "POST /get_rollout_data calls answered.", [({}, polls["count"])]
    )
    out.metric(
        "polls_with_data_total",
        "counter",
        "Polls that returned groups.",
        [({}, polls["with_data"])],
    )
    out.metric(
        "polls_replayed_total",
        "counter",
        "Polls answered from a kept batch: a request_id retried, or resumed after a give-up.",
        [({}, polls["replayed"])],
    )
    name = PREFIX + "poll_duration_seconds"
    out.lines.append(f"# HELP {name} Time to answer POST /get_rollout_data.")
    out.lines.append(f"# TYPE {name} histogram")
    cumulative = 0
    for bound, count in polls["buckets"].items():
        cumulative += count
        out.sample(
            name + "_bucket", {"le": "+Inf" if math.isinf(bound) else repr(bound)}, cumulative
        )
    out.sample(name + "_sum", {}, float(polls["seconds_total"]))
    out.sample(name + "_count", {}, polls["count"])
    _gate(out, service.admission())
    out.metric(
        "launcher_running",
        "gauge",
        "1 while the launcher process runs.",
        [({}, bool(launcher["running"]))],
    )
    out.metric(
        "launcher_restarts_total",
        "counter",
        "Launcher restarts by the supervisor.",
        [({}, launcher.get("restarts") or 0)],
    )
    code = launcher.get("exit_code")
    if code is not None:
        out.metric(
            "launcher_exit_code",
            "gauge",
            "Exit code of the last launcher that ended.",
            [({}, code)],
        )
    out.metric(
        "proxy_pending_sessions",
        "gauge",
        "Sessions waiting to be cleared at the LLM proxy.",
        [({}, notif.get("sessions", 0))],
    )
    out.metric(
        "proxy_failures_total",
        "counter",
        "Failed clear_sessions attempts.",
        [({}, notif.get("failures", 0))],
    )
    out.metric(
        "proxy_delivered_calls_total",
        "counter",
        "Successful clear_sessions calls.",
        [({}, notif.get("delivered_calls", 0))],
    )
    out.metric(
        "database_up",
        "gauge",
        "0 while background reads are failing.",
        [({}, stats["database"] == "ok")],
    )
    lease = stats["lease"]
    out.metric(
        "role",
        "gauge",
        "1 for this instance's role: owner, standby, or starting (before it read the lease).",
        [({"role": role}, lease["role"] == role) for role in ("owner", "standby", "starting")],
    )
    out.metric(
        "lease_renewals_total",
        "counter",
        "Lease renewals by this instance as the owner.",
        [({}, lease.get("renewals", 0))],
    )
    out.metric(
        "lease_renewal_failures_total",
        "counter",
        "Lease renewals that failed (the database did not answer).",
        [({}, lease.get("renewal_failures", 0))],
    )
    out.metric(
        "takeovers_total",
        "counter",
        "Times this instance took the job over from another owner.",
        [({}, lease.get("takeovers", 0))],
    )
    out.metric(
        "takeover_duration_seconds",
        "gauge",
        "The last takeover: from the end of the previous owner's "
        "lease until this instance had loaded the job.",
        [({}, lease.get("last_takeover_s") or 0.0)],
    )
    return "\n".join(out.lines) + "\n"
