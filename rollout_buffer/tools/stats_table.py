"""``/stats`` as a readable table (``rollout-buffer stats``, ``stats --watch``).

Owns: formatting a /stats document for a terminal. Pure text: it must not do I/O or HTTP.
"""

from __future__ import annotations

from typing import Any


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3f}".rstrip("0").rstrip(".") if v != int(v) else f"{int(v)}"
    return str(v)


def _by_reason(d: Any) -> str:
    if not isinstance(d, dict) or not d:
        return ""
    return "  (" + ", ".join(f"{k}: {v}" for k, v in sorted(d.items())) + ")"


def format_stats(stats: dict[str, Any]) -> str:
    """GET /stats as a readable fixed-width table."""
    rows: list[tuple[str, str]] = []

    def add(label: str, value: Any, extra: str = "") -> None:
        rows.append((label, _fmt(value) + extra))

    def section(title: str) -> None:
        rows.append(("", ""))
        rows.append((f"[{title}]", ""))

    job = stats.get("job_session") or stats.get("job_id")
    add("job", job if job is not None else "(none: no /start_rollout yet)")
    if "k" in stats:
        add("K (sessions per group)", stats.get("k"))
    lease = stats.get("lease")
    if isinstance(lease, dict) and lease.get("role"):
        add("role", lease.get("role"))  # owner, standby (its /health names the owner) or starting
    add("database", stats.get("database"))
    r = stats.get("rows")
    if isinstance(r, dict):
        section("rows")
        add("read", r.get("read"))
        add("served", r.get("served"))
        add("dropped", r.get("dropped_total"), _by_reason(r.get("dropped")))
        add("rejected", r.get("rejected_total"), _by_reason(r.get("rejected")))
        add("pending", r.get("pending"))
        if "accounting_balanced" in stats:
            add("accounting balanced", stats.get("accounting_balanced"))
    g = stats.get("groups")
    if isinstance(g, dict):
        section("groups")
        add("pending", g.get("pending"))
        add("ready", g.get("ready"))
        if "in_flight" in g:
            add("in flight", g.get("in_flight"))
        add("served", g.get("served"))
        add("dropped", g.get("dropped_total"), _by_reason(g.get("dropped")))
    f = stats.get("figures")
    if isinstance(f, dict):
        section("figures (steps per session, mean terminal reward)")
        for label, fig in [("served", f.get("served") or {})] + sorted(
            (f.get("dropped") or {}).items()
        ):
            add(label, fig.get("steps_per_session"), f", {_fmt(fig.get('terminal_reward_mean'))}")
    v = stats.get("versions")
    if isinstance(v, dict):
        add(
            "weight version",
            v.get("current"),
            f"  (trainer {_fmt(v.get('trainer'))}, rows {_fmt(v.get('rows'))})",
        )
    if r is not None or "cursor" in stats:
        section("ingest")
        add("cursor (last id read)", stats.get("cursor"))
        if stats.get("floor_pk"):
            add("restart floor id", stats.get("floor_pk"))
        add("lag (rows not yet read)", stats.get("lag_rows"))
        age = stats.get("oldest_pending_group_age_s")
        add("oldest pending group age", None if age is None else f"{age:.1f} s")
    la = stats.get("launcher")
    if isinstance(la, dict):
        section("launcher")
        add("running", la.get("running"))
        add("pid", la.get("pid"))
        add("exit code", la.get("exit_code"))
        add("restarts", la.get("restarts"))
        add("finished", la.get("finished"))
        if la.get("stopped_by"):
            add("stopped by", la.get("stopped_by"))
        if la.get("log_path"):
            add("log", la.get("log_path"))
    px = stats.get("proxy_notifications")
    if isinstance(px, dict):
        section("proxy")
        add("sessions pending clear", px.get("sessions"), _by_reason(px.get("reasons")))
        if "failures" in px:
            add("delivery failures", px.get("failures"))
    polls = stats.get("polls")
    if isinstance(polls, dict):
        section("polls")
        add("count", polls.get("count"))
        add("with data", polls.get("with_data"))
    width = max(len(label) for label, _ in rows)
    lines = []
    for label, value in rows:
        if not label and not value:
            lines.append("")
        elif label.startswith("[") and not value:
            lines.append(label)
        else:
            lines.append(f"  {label:<{width}}  {value}")
    return "\n".join(lines)
