#!/usr/bin/env python3
"""A seeded failover soak: three instances on one database, attacked at random while a trainer
drains.

python tests/bench/failover_soak.py [--seed 7] [--seconds 90] [--backend postgres|sqlite] [--lease
3]

Three ``rollout-buffer serve`` (gunicorn, LAUNCHER=none, each its own ROLLOUT_BUFFER_HOST_ID, so
on Postgres a standby waits for the lease to end), an external writer adding a complete group
every 30 ms, and a BufferClient holding the three URLs that drains with random max_groups. Every
0.5-3 s one attack, chosen by the seed: kill -9 of the owner; kill -9 of any instance; SIGSTOP of
the owner for 0.3-2.5 leases, then SIGCONT; kill -9 of the owner and then of the next owner the
moment it takes over; (Postgres) SIGSTOP of the owner inside a fenced transaction (caught by
holding the job's row while rows arrive), which another instance must take over within the lease
plus 5 s. The three are one buffer (ROLLOUT_BUFFER_NAME=soak); a fourth instance on the same
database is another buffer (ROLLOUT_BUFFER_NAME=other) with its own job, writer and trainer, never
attacked. Killed instances come back as standbys. At the end every group written must have reached
its own trainer exactly once (neither trainer may ever get the other job's group), every decided
group must be served, and no instance may have met a conflicting decision (the fence keeps a
paused owner from making one). A failure prints the seed and the command that reruns it; exit 1.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # tests/: support.py

import psycopg  # noqa: E402
from failover_bench import Instance, fresh_database, keep_writing, wait  # noqa: E402
from support import paused_in_fence  # noqa: E402

from rollout_buffer.client import BufferClient, groups_of  # noqa: E402
from rollout_buffer.storage.db import connect  # noqa: E402
from rollout_buffer.storage.launcher_tables import create_launcher_tables  # noqa: E402


def pause_in_fence(url: str, owner: Instance, others: list[Instance], lease: float) -> str:
    """SIGSTOP the owner inside a fenced transaction (support.paused_in_fence), until another
    instance owns the job (at most the lease plus 5 s), then SIGCONT. Returns what happened."""
    assert owner.proc is not None and owner.proc.pid is not None
    with paused_in_fence(url, "J", owner.proc.pid) as caught:
        if not caught:
            return "skipped (no fenced save seen)"
        paused_at = time.monotonic()
        while not any(i.proc is not None and i.role() == "owner" for i in others):
            if time.monotonic() - paused_at > lease + 5:
                return f"FAILOVER BLOCKED: no takeover {lease + 5:g} s after the pause"
            time.sleep(0.05)
        return f"taken over after {time.monotonic() - paused_at:.1f} s"


ATTACKS = ["kill_owner", "kill_owner", "kill_any", "stop_owner", "kill_twice"]
FENCED = ["stop_in_fence"]  # Postgres only


def revive(insts: list[Instance], rng: random.Random) -> None:
    """Killed instances come back as standbys (most of them at once); never none at all."""
    for inst in insts:
        if inst.proc is None and rng.random() < 0.7:
            inst.start()
    if all(i.proc is None for i in insts):
        insts[0].start()


def attack_once(
    n: int,
    attack: str,
    rng: random.Random,
    insts: list[Instance],
    owner: Callable[[], Instance | None],
    url: str,
    lease: float,
) -> list[str]:
    """One attack on the buffer's instances; returns the failovers it saw blocked."""
    o = owner()
    alive = [i for i in insts if i.proc is not None]
    if attack == "kill_any" and alive:
        victim = rng.choice(alive)
        print(f"  {n:3d} kill -9 {victim.name}", flush=True)
        victim.kill9()
    elif attack == "stop_in_fence" and o is not None:
        print(f"  {n:3d} SIGSTOP the owner {o.name} inside a fenced transaction", flush=True)
        what = pause_in_fence(url, o, [i for i in insts if i is not o], lease)
        print(f"      {what}", flush=True)
        if what.startswith("FAILOVER BLOCKED"):
            return [what]
    elif attack == "stop_owner" and o is not None:
        pause = rng.uniform(0.3, 2.5) * lease
        print(f"  {n:3d} SIGSTOP the owner {o.name} for {pause:.1f} s", flush=True)
        os.killpg(o.proc.pid, signal.SIGSTOP)
        time.sleep(pause)
        os.killpg(o.proc.pid, signal.SIGCONT)
    elif o is not None:
        print(
            f"  {n:3d} kill -9 the owner {o.name}"
            + (" and the next one as it takes over" if attack == "kill_twice" else ""),
            flush=True,
        )
        o.kill9()
        if attack == "kill_twice":
            deadline = time.monotonic() + lease + 10
            while time.monotonic() < deadline and (nxt := owner()) is None:
                time.sleep(0.01)
            if nxt is not None:
                nxt.kill9()
    return []


def soak(args: argparse.Namespace, url: str, work: str) -> bool:
    rng = random.Random(args.seed)
    insts = [Instance(n, url, work, args.lease, f"host-{n}", "soak") for n in "abc"]
    bystander = Instance("z", url, work, args.lease, "host-z", "other")
    written: list[str] = []
    written_other: list[str] = []
    got: collections.Counter = collections.Counter()
    got_other: collections.Counter = collections.Counter()
    stop = threading.Event()
    failures: list[BaseException] = []
    blocked: list[str] = []

    def trainer(
        client: BufferClient, pick: random.Random, want: list[str], into: collections.Counter
    ) -> None:
        try:
            while not stop.is_set() or set(want) - set(into):
                doc = client.get_rollout_data(max_groups=pick.choice([1, 2, 5, 16]), wait_s=0.3)
                for gid, _items in groups_of(doc) if doc.get("success") else []:
                    into[gid] += 1
        except BaseException as exc:
            failures.append(exc)

    def owner() -> Instance | None:
        return next((i for i in insts if i.proc is not None and i.role() == "owner"), None)

    try:
        for inst in [*insts, bystander]:
            inst.start()
        wait(lambda: owner() is not None, 30, "an owner")
        client = BufferClient(
            [i.url for i in insts], retries=400, backoff_s=0.05, backoff_max_s=0.5, timeout=30
        )
        client.start_rollout(num_repeat_per_sample=2, job_session="J")
        other = BufferClient(bystander.url, retries=400, backoff_s=0.05, timeout=30)
        other.start_rollout(num_repeat_per_sample=2, job_session="Z")
        threads = [
            threading.Thread(target=keep_writing, args=(url, written, stop, 0.03), daemon=True),
            threading.Thread(
                target=trainer,
                args=(client, random.Random(args.seed + 1), written, got),
                daemon=True,
            ),
            threading.Thread(
                target=keep_writing,
                args=(url, written_other, stop, 0.1, "Z", "z"),
                daemon=True,
            ),
            threading.Thread(
                target=trainer,
                args=(other, random.Random(args.seed + 2), written_other, got_other),
                daemon=True,
            ),
        ]
        for t in threads:
            t.start()
        end = time.monotonic() + args.seconds
        n = 0
        while time.monotonic() < end:
            time.sleep(rng.uniform(0.5, 3.0))
            n += 1
            attack = rng.choice(ATTACKS + (FENCED if url.startswith("postgres") else []))
            if n == 1 and url.startswith("postgres"):  # every Postgres run has one, however short
                attack = FENCED[0]
            blocked += attack_once(n, attack, rng, insts, owner, url, args.lease)
            revive(insts, rng)
        for inst in insts:
            if inst.proc is None:
                inst.start()
        stop.set()
        threads[0].join(10)
        threads[2].join(10)
        threads[1].join(90)
        threads[3].join(90)
        client.close()
        other.close()
    finally:
        for inst in [*insts, bystander]:
            if inst.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(inst.proc.pid, signal.SIGCONT)
                inst.proc.stop()
    return verdict(
        args, url, insts, (written, got), (written_other, got_other), n, blocked, failures
    )


def verdict(
    args: argparse.Namespace,
    url: str,
    insts: list[Instance],
    mine: tuple[list[str], collections.Counter],
    other: tuple[list[str], collections.Counter],
    n: int,
    blocked: list[str],
    failures: list[BaseException],
) -> bool:
    """Every group written reached its own buffer's trainer exactly once, and nothing else broke."""
    (written, got), (written_other, got_other) = mine, other
    db = connect(url)
    statuses = dict(db.rows("SELECT status, COUNT(*) FROM rollout_buffer_groups GROUP BY status"))
    db.close()
    missing = sorted(set(written) - set(got)) + sorted(set(written_other) - set(got_other))
    twice = {g: c for g, c in (got + got_other).items() if c > 1}
    crossed = sorted(set(got) & set(written_other)) + sorted(set(got_other) & set(written))
    conflicts = 0
    for inst in insts:
        with open(inst.log, encoding="utf-8", errors="replace") as log:
            conflicts += log.read().count("conflicting decision")
    print(
        f"\nseed {args.seed}: {n} attacks; {len(written)} + {len(written_other)} groups written "
        f"(the other buffer's second), {len(got)} + {len(got_other)} received, missing "
        f"{len(missing)}, more than once {len(twice)}, to the other buffer's trainer "
        f"{len(crossed)}; "
        f"decided {statuses}; conflicting decisions {conflicts}; failovers blocked {blocked}; "
        f"trainer errors {failures}"
    )
    return not (
        missing
        or twice
        or crossed
        or conflicts
        or failures
        or blocked
        or set(statuses) - {"served"}
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--seed", type=int, default=random.randrange(1 << 30))
    p.add_argument("--seconds", type=float, default=90.0)
    p.add_argument("--backend", choices=("postgres", "sqlite"), default="postgres")
    p.add_argument("--lease", type=float, default=3.0)
    p.add_argument("--pg", default="postgresql://root@127.0.0.1:5432/test")
    args = p.parse_args(argv)
    logging.getLogger("rollout_buffer.client").setLevel(logging.ERROR)
    work = tempfile.mkdtemp(prefix="rb-soak-")
    schema = None
    if args.backend == "sqlite":
        url = "sqlite://" + os.path.join(work, "launcher.db")
        db = connect(url)
        create_launcher_tables(db)
        db.close()
    else:
        url, schema = fresh_database(args, "rbsoak_")
    print(
        f"failover soak: seed {args.seed}, {args.backend}, lease {args.lease:g} s, "
        f"{args.seconds:g} s (logs in {work})"
    )
    try:
        ok = soak(args, url, work)
    finally:
        if schema:
            with psycopg.connect(args.pg, autocommit=True) as conn:
                conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    if not ok:
        print(
            f"FAILED; rerun: python tests/bench/failover_soak.py --seed {args.seed} "
            f"--backend {args.backend} --seconds {args.seconds:g} --lease {args.lease:g}"
        )
        return 1
    print("ok: every group exactly once, nothing decided twice")
    return 0


if __name__ == "__main__":
    sys.exit(main())
