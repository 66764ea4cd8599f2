"""What the demo's trainer checks in every group it receives, and the summary it prints at the
end, with every drop explained in a newcomer's words.

Owns: the checks and the summary table. It must not talk to the service: the demo hands it the
groups it received and the last ``/stats``.
"""

from __future__ import annotations

import collections
import json
from typing import Any, TextIO

from rollout_buffer.tools.runner import log_tail

POLICY_REASONS = ("stale", "zero_variance", "oversampled")


class Checker:
    """What the trainer verifies about every group it receives."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.groups: list[str] = []
        self.seen: set[str] = set()
        self.items = 0
        self.sessions = 0
        self.rewards: list[float] = []
        self.session_rewards: list[float] = []
        self.problems: list[str] = []

    def add(self, gid: str, items: list[dict[str, Any]]) -> None:
        if gid in self.seen:
            self.problems.append(f"group {gid} received twice")
            return
        self.seen.add(gid)
        self.groups.append(gid)
        self.items += len(items)
        by_session: dict[str, set[float]] = collections.defaultdict(set)
        for it in items:
            extra = it.get("extra_info") or {}
            sid = extra.get("session_id")
            reward = it.get("reward")
            if sid is None or reward is None:
                self.problems.append(f"group {gid}: an item lacks extra_info.session_id or reward")
                continue
            by_session[sid].add(float(reward))
            self.rewards.append(float(reward))
        if len(by_session) != self.k:
            self.problems.append(
                f"group {gid}: {len(by_session)} distinct sessions, expected K={self.k}"
            )
        for sid, rs in by_session.items():
            if len(rs) != 1:
                self.problems.append(
                    f"group {gid}: session {sid} has items with different rewards {sorted(rs)}"
                )
            self.session_rewards.append(next(iter(rs)))
        self.sessions += len(by_session)


# Why a group is dropped, in a newcomer's words (the reasons /stats counts).
DROP_EXPLAINED = {
    "launcher_exited": "a session of the group crashed or hit the step cap (--max-steps) without "
    "a result, so the group could never reach K; dropped when the launcher finished",
    "session_without_result": "a session of the group ended without a result (it hit the step "
    "cap, or failed for good), so the group could never reach K; dropped as soon as that was "
    "known",
    "incomplete_group_ttl": "the group waited longer than the TTL for its last sessions",
    "malformed_row": "a row of the group could not be turned into an item",
    "job_ended": "a new job started before the group completed",
    "stale": "its weight version was too old for the trainer (staleness policy)",
    "zero_variance": "all its sessions had the same reward: no learning signal (policy)",
    "oversampled": "the extra sessions of an over-sampled group, once K had completed",
    "restart_training": "the trainer restarted past the group's rows",
}


# With salvage on (ROLLOUT_BUFFER_SALVAGE=truncate), what is left to drop a group.
SALVAGE_DROP_EXPLAINED = {
    "launcher_exited": "a session of the group failed before writing any row, so salvage had "
    "nothing to serve for it and the group could never reach K; dropped when the launcher "
    "finished",
    "incomplete_group_ttl": "a session of the group wrote no row before the TTL, so salvage had "
    "nothing to serve for it",
}


def explain_drops(dropped: Any, salvage: bool = False) -> list[str]:
    """One line per drop reason: how many groups, and why such groups are dropped."""
    if not isinstance(dropped, dict):
        return []
    words = {**DROP_EXPLAINED, **SALVAGE_DROP_EXPLAINED} if salvage else DROP_EXPLAINED
    return [
        f"{n} {reason}: {words.get(reason, 'see docs/how-it-works.md')}"
        for reason, n in sorted(dropped.items())
        if n
    ]


def salvage_line(salvaged: Any) -> str:
    """The summary's salvage row: the groups salvage kept, their truncated sessions, and the
    generation time they kept."""
    if not isinstance(salvaged, dict):
        return "-"
    groups = salvaged.get("groups") or {}
    sessions = salvaged.get("sessions") or {}
    return (
        f"kept {sum(groups.values())} groups ({_reasons(groups)}) with "
        f"{sum(sessions.values())} truncated sessions ({_reasons(sessions)}), "
        f"{float(salvaged.get('generation_seconds_kept') or 0.0):.1f} s of generation"
    )


def explain_counts(
    checker: Checker, groups: dict[str, Any], rows: dict[str, Any], sim: dict[str, Any] | None
) -> list[str]:
    """With the policies on, why the simulator's counts and the trainer's differ: one line for
    each count that does (over-sampling plays more sessions than it serves, a group is served
    before all its sessions complete, a policy drops groups that did complete)."""
    if sim is None:
        return []
    k, played = checker.k, int(sim.get("k") or checker.k)
    served = len(checker.groups)
    lines = []
    if sim.get("sessions") != checker.sessions:
        why = [f"the {groups.get('dropped_total', 0)} dropped groups serve none"]
        if played > k:
            why.insert(0, f"over-sampling plays {played} sessions a group and serves the first {k}")
        lines.append(
            f"sessions: the simulator played {sim.get('groups')} groups x {played} = "
            f"{sim.get('sessions')}, the trainer received {served} groups x {k} = "
            f"{checker.sessions}: " + ", and ".join(why)
        )
    complete = sim.get("complete_groups")
    if complete != served:
        by_policy = {
            reason: n
            for reason, n in sorted((groups.get("dropped") or {}).items())
            if reason in ("stale", "zero_variance") and n
        }
        policy_text = ", ".join(f"{n} {reason}" for reason, n in by_policy.items()) or "none"
        lines.append(
            f"groups: the simulator's {complete} complete groups are those whose {played} "
            f"sessions all completed; a group is served once {k} have (so a group with one "
            f"session that crashed is served too), and a policy drops some that completed "
            f"({policy_text}): {served} served"
        )
    oversampled = (rows.get("dropped") or {}).get("oversampled", 0)
    if oversampled:
        lines.append(
            f"oversampled {oversampled} rows: the rows of the sessions that completed after their "
            f"group's first {k}; they are read but never served"
        )
    return lines


def _reasons(d: Any) -> str:
    if not isinstance(d, dict) or not d:
        return "none"
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items()))


def salvage_problems(
    sim: dict[str, Any], groups: dict[str, Any], kept: int, served: int
) -> list[str]:
    """With salvage on: every group is served, the complete ones and those salvage kept, but the
    groups with a session that wrote no row (salvage cannot keep those: they are the only drops)."""
    problems = []
    complete = int(sim.get("complete_groups") or 0)
    if served != complete + kept:
        problems.append(
            f"the simulator completed {complete} groups and salvage kept {kept}, the trainer "
            f"received {served}"
        )
    silent = sim.get("groups_with_silent_session")
    if silent is not None and groups.get("dropped_total", 0) != silent:
        problems.append(
            f"{groups.get('dropped_total', 0)} groups dropped, but only the {silent} with a "
            "session that wrote no row should be"
        )
    return problems


def launcher_summary(log_path: str | None) -> dict[str, Any] | None:
    """The simulator's final ``SIMULATE {json}`` line from its log, or None."""
    if not log_path:
        return None
    for line in reversed(log_tail(log_path, 20).splitlines()):
        if line.startswith("SIMULATE "):
            try:
                return json.loads(line[len("SIMULATE ") :])
            except ValueError:
                return None
    return None


def summarize(
    out: TextIO,
    checker: Checker,
    stats: dict[str, Any],
    *,
    wall: float,
    job_time: float,
    paths: dict[str, str],
    timed_out: bool,
    timeout: float,
    policies: bool = False,
    salvage: bool = False,
) -> int:
    g = stats.get("groups") or {}
    r = stats.get("rows") or {}
    balanced = stats.get("accounting_balanced")
    served_by_server = g.get("served")
    problems = list(checker.problems)
    if timed_out:
        problems.append(
            f"timed out after {timeout:g} s before the launcher finished and the buffer drained"
        )
    if not checker.groups:
        problems.append("no group was served")
    if balanced is not True:
        problems.append(f"accounting not balanced in /stats: rows {r}")
    sim = launcher_summary((stats.get("launcher") or {}).get("log_path"))
    by_policy = {k: v for k, v in (g.get("dropped") or {}).items() if k in POLICY_REASONS}
    kept = sum(((stats.get("salvaged") or {}).get("groups") or {}).values()) if salvage else 0
    if salvage and not policies and sim is not None and not timed_out:
        # (with the policies too, their check below holds: they drop some groups salvage kept)
        problems += salvage_problems(sim, g, kept, len(checker.groups))
    elif (
        not salvage
        and sim is not None
        and not timed_out
        and not policies
        and sim.get("complete_groups") != len(checker.groups)
    ):
        problems.append(
            f"the simulator completed {sim.get('complete_groups')} groups, the trainer received "
            f"{len(checker.groups)}"
        )
    if (
        sim is not None
        and not timed_out
        and policies
        and sim.get("complete_groups", 0) > len(checker.groups) + sum(by_policy.values())
    ):
        # over-sampling serves a group once K of its K+1 sessions completed: more may be served
        problems.append(
            f"the simulator completed {sim.get('complete_groups')} groups, the trainer received "
            f"{len(checker.groups)} and {sum(by_policy.values())} were dropped by a policy"
        )
    if served_by_server is not None and served_by_server != len(checker.groups):
        problems.append(
            f"/stats says {served_by_server} groups served, the trainer received "
            f"{len(checker.groups)}"
        )
    avg = sum(checker.rewards) / len(checker.rewards) if checker.rewards else 0.0
    avg_s = (
        sum(checker.session_rewards) / len(checker.session_rewards)
        if checker.session_rewards
        else 0.0
    )
    rows = [
        ("groups served", f"{len(checker.groups)}"),
        ("items (steps)", f"{checker.items}"),
        ("sessions", f"{checker.sessions}"),
        ("dropped groups", f"{g.get('dropped_total', 0)}  ({_reasons(g.get('dropped'))})"),
        *([("salvage", salvage_line(stats.get("salvaged")))] if salvage else []),
        ("rejected rows", f"{r.get('rejected_total', 0)}  ({_reasons(r.get('rejected'))})"),
        *(
            [
                (
                    "policies",
                    f"stale {by_policy.get('stale', 0)} groups, zero_variance "
                    f"{by_policy.get('zero_variance', 0)} groups, oversampled "
                    f"{(r.get('dropped') or {}).get('oversampled', 0)} rows",
                )
            ]
            if policies
            else []
        ),
        (
            "rows read",
            f"{r.get('read', 0)}  (served {r.get('served', 0)}, "
            f"dropped {r.get('dropped_total', 0)}, "
            f"pending {r.get('pending', 0)})",
        ),
        ("avg reward", f"{avg:.3f} per item, {avg_s:.3f} per session"),
        (
            "wall time",
            f"{wall:.1f} s, of which {job_time:.1f} s from the job's start to its last group",
        ),
        (
            "simulator",
            "-"
            if sim is None
            else f"{sim.get('sessions')} sessions ({sim.get('completed_sessions')} "
            f"completed, {sim.get('capped_sessions')} at the step cap, "
            f"{sim.get('failed_sessions')} crashed), {sim.get('complete_groups')} complete groups",
        ),
        *paths.items(),
        ("accounting balanced", "yes" if balanced is True else "no"),
        ("checks", "passed" if not problems else f"FAILED ({len(problems)})"),
    ]
    width = max(len(a) for a, _ in rows)
    out.write("\nsummary\n")
    for label, value in rows:
        out.write(f"  {label:<{width}}  {value}\n")
    explained = explain_drops(g.get("dropped"), salvage)
    if explained:
        out.write("\nwhy groups were dropped\n")
        for line in explained:
            out.write(f"  {line}\n")
    differ = explain_counts(checker, g, r, sim) if policies else []
    if differ:
        out.write("\nwhy the counts differ\n")
        for line in differ:
            out.write(f"  {line}\n")
    for p in problems[:20]:
        out.write(f"  ! {p}\n")
    if len(problems) > 20:
        out.write(f"  ! ... and {len(problems) - 20} more\n")
    out.flush()
    return 0 if not problems else 1
