"""``/stats`` as a readable table (``rollout-buffer stats``, ``stats --watch``).

Owns: formatting a /stats document for a terminal. Pure text: it must not do I/O or HTTP.
"""

from __future__ import annotations

from typing import Any


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3f}".rstrip("0").rstrip(".") if value != int(value) else f"{int(value)}"
    return str(value)


def _by_reason(counts: Any) -> str:
    if not isinstance(counts, dict) or not counts:
        return ""
    return "  (" + ", ".join(f"{key}: {value}" for key, value in sorted(counts.items())) + ")"


class _Table:
    """Rows of (label, value) text; a section is a blank row and a [title] row."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str]] = []

    def add(self, label: str, value: Any, extra: str = "") -> None:
        self.rows.append((label, _fmt(value) + extra))

    def section(self, title: str) -> None:
        self.rows.append(("", ""))
        self.rows.append((f"[{title}]", ""))

    def render(self) -> str:
        width = max(len(label) for label, _ in self.rows)
        lines = []
        for label, value in self.rows:
            if not label and not value:
                lines.append("")
            elif label.startswith("[") and not value:
                lines.append(label)
            else:
                lines.append(f"  {label:<{width}}  {value}")
        return "\n".join(lines)


def format_stats(stats: dict[str, Any]) -> str:
    """GET /stats as a readable fixed-width table."""
    table = _Table()
    job = stats.get("job_session") or stats.get("job_id")
    table.add("job", job if job is not None else "(none: no /start_rollout yet)")
    if "k" in stats:
        table.add("K (sessions per group)", stats.get("k"))
    lease = stats.get("lease")
    if isinstance(lease, dict) and lease.get("role"):
        # owner, standby (its /health names the owner) or starting
        table.add("role", lease.get("role"))
    table.add("database", stats.get("database"))
    for part in (_rows, _groups, _figures, _versions, _ingest, _launcher, _proxy, _polls):
        part(table, stats)
    return table.render()


def _rows(table: _Table, stats: dict[str, Any]) -> None:
    rows = stats.get("rows")
    if not isinstance(rows, dict):
        return
    table.section("rows")
    table.add("read", rows.get("read"))
    table.add("served", rows.get("served"))
    table.add("dropped", rows.get("dropped_total"), _by_reason(rows.get("dropped")))
    table.add("rejected", rows.get("rejected_total"), _by_reason(rows.get("rejected")))
    table.add("pending", rows.get("pending"))
    if "accounting_balanced" in stats:
        table.add("accounting balanced", stats.get("accounting_balanced"))


def _groups(table: _Table, stats: dict[str, Any]) -> None:
    groups = stats.get("groups")
    if not isinstance(groups, dict):
        return
    table.section("groups")
    table.add("pending", groups.get("pending"))
    table.add("ready", groups.get("ready"))
    if "in_flight" in groups:
        table.add("in flight", groups.get("in_flight"))
    table.add("served", groups.get("served"))
    table.add("dropped", groups.get("dropped_total"), _by_reason(groups.get("dropped")))
    salvaged = stats.get("salvaged")
    if isinstance(salvaged, dict):  # served with truncated sessions (issue 38)
        table.add(
            "salvaged",
            sum((salvaged.get("groups") or {}).values()),
            f"{_by_reason(salvaged.get('groups'))}, sessions "
            f"{sum((salvaged.get('sessions') or {}).values())}"
            f"{_by_reason(salvaged.get('sessions'))}, "
            f"{_fmt(salvaged.get('generation_seconds_kept'))} generation s kept",
        )


def _figures(table: _Table, stats: dict[str, Any]) -> None:
    figures = stats.get("figures")
    if not isinstance(figures, dict):
        return
    table.section("figures (steps per session, mean terminal reward)")
    dropped = sorted((figures.get("dropped") or {}).items())
    for label, figure in [("served", figures.get("served") or {}), *dropped]:
        table.add(
            label,
            figure.get("steps_per_session"),
            f", {_fmt(figure.get('terminal_reward_mean'))}",
        )


def _versions(table: _Table, stats: dict[str, Any]) -> None:
    versions = stats.get("versions")
    if isinstance(versions, dict):
        table.add(
            "weight version",
            versions.get("current"),
            f"  (trainer {_fmt(versions.get('trainer'))}, rows {_fmt(versions.get('rows'))})",
        )


def _ingest(table: _Table, stats: dict[str, Any]) -> None:
    if stats.get("rows") is None and "cursor" not in stats:
        return
    table.section("ingest")
    table.add("cursor (last id read)", stats.get("cursor"))
    if stats.get("floor_pk"):
        table.add("restart floor id", stats.get("floor_pk"))
    table.add("lag (rows not yet read)", stats.get("lag_rows"))
    age = stats.get("oldest_pending_group_age_s")
    table.add("oldest pending group age", None if age is None else f"{age:.1f} s")


def _launcher(table: _Table, stats: dict[str, Any]) -> None:
    launcher = stats.get("launcher")
    if not isinstance(launcher, dict):
        return
    table.section("launcher")
    table.add("running", launcher.get("running"))
    table.add("pid", launcher.get("pid"))
    table.add("exit code", launcher.get("exit_code"))
    table.add("restarts", launcher.get("restarts"))
    table.add("finished", launcher.get("finished"))
    if launcher.get("stopped_by"):
        table.add("stopped by", launcher.get("stopped_by"))
    if launcher.get("log_path"):
        table.add("log", launcher.get("log_path"))


def _proxy(table: _Table, stats: dict[str, Any]) -> None:
    proxy = stats.get("proxy_notifications")
    if not isinstance(proxy, dict):
        return
    table.section("proxy")
    table.add("sessions pending clear", proxy.get("sessions"), _by_reason(proxy.get("reasons")))
    if "failures" in proxy:
        table.add("delivery failures", proxy.get("failures"))


def _polls(table: _Table, stats: dict[str, Any]) -> None:
    polls = stats.get("polls")
    if isinstance(polls, dict):
        table.section("polls")
        table.add("count", polls.get("count"))
        table.add("with data", polls.get("with_data"))
