"""The real stack: the unmodified upstream launcher (Safactory ``launcher.py``, its
``math500_text`` environment, ``--env-transport inproc``) run by a real ``rollout-buffer serve``,
its model calls answered by a stand-in LLM proxy, and a trainer that polls as the upstream client
does.

The copy comes from ``tests/realstack/setup_upstream.py`` (nothing upstream is in this
repository); ``RBTEST_REALSTACK`` names the directory it made. :func:`run` makes one run and
returns what it saw: the test tier (``test_realstack.py``) asserts on it, the bench
(``tests/bench/realstack.py``) prints its figures.

How the service runs the launcher: as an operator would, ``AIEVOBOX_ROOT`` is the extracted tree
and the launcher's venv comes first on ``PATH``, so the service's own command (``python3
$AIEVOBOX_ROOT/launcher.py ...``, SPEC §5) runs it, whatever ``--llm-base-url`` pacing gives it.
The service itself runs on this interpreter.

The run: N problems ``Compute A+B.`` (one group each), K sessions a group, each session
``max_turns`` model calls (the stand-in never answers right, so none ends early), a pool of
``pool`` sessions, ``latency_s`` a call. The trainer: ``POST /get_rollout_data`` with ``{}``;
after ``success=false`` it sleeps ``empty_sleep_s`` (3 s upstream) and polls again; after a
batch it trains ``train_s``, then moves the policy on (the stand-in stamps the next
``weight_version``, as a proxy serving the new weights does).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import requests
from fakes.fake_llm import FakeLLM

from rollout_buffer.storage.db import StorageError, connect
from rollout_buffer.tools.runner import ServerProcess, clean_env, free_port, log_tail

ROOT = Path(__file__).resolve().parents[2]
VARIABLE = "RBTEST_REALSTACK"
SETUP = "python tests/realstack/setup_upstream.py --copy PATH_TO_SAFACTORY"
ADMISSION_EVERY_S = 0.25  # how often the gate's held calls are sampled


class UpstreamError(Exception):
    """RBTEST_REALSTACK is set but does not name a usable setup (said for the person)."""


@dataclasses.dataclass(frozen=True)
class Upstream:
    """A copy made by setup_upstream.py: the extracted tree, the launcher's venv, its commit."""

    dest: Path
    tree: Path
    python: Path
    commit: str | None

    @classmethod
    def from_env(cls) -> Upstream | None:
        """The setup that RBTEST_REALSTACK names; None when it is unset."""
        value = os.environ.get(VARIABLE)
        if not value:
            return None
        dest = Path(value)
        try:
            manifest = json.loads((dest / "realstack.json").read_text())
        except (OSError, ValueError) as exc:
            raise UpstreamError(
                f"{VARIABLE}={value} has no readable realstack.json ({exc}): "
                f"make it with `{SETUP} --dest {value}`"
            ) from None
        upstream = cls(
            dest, Path(manifest["tree"]), Path(manifest["python"]), manifest.get("commit")
        )
        for path in (upstream.tree / "launcher.py", upstream.python):
            if not path.exists():
                raise UpstreamError(
                    f"{path} is missing: make the setup again with `{SETUP} --dest {value}`"
                )
        return upstream


def skip_reason() -> str:
    return (
        f"the real-launcher tier needs a copy of the upstream launcher (AI45Lab/Safactory): "
        f"run `{SETUP}`, then set {VARIABLE} to the directory it prints"
    )


@dataclasses.dataclass(frozen=True)
class Params:
    groups: int = 12
    k: int = 4
    max_turns: int = 3
    pool: int = 8
    latency_s: float = 0.05
    batch_groups: int = 2  # B: the groups the trainer trains on a step (rollout_batch_size)
    tell_batch_groups: bool = True  # ROLLOUT_BUFFER_PACING_BATCH_GROUPS=B, as docs/pacing.md says
    fetch_sleep_s: float = 5.0  # the upstream client's sleep before each fetch
    empty_sleep_s: float = 3.0  # its sleep after success=false
    # what a step takes the trainer: no shorter than the upstream waits around it (the client's
    # 5 s before a fetch, the launcher's 5 s write buffer); at 2 s those waits were most of the
    # run, and pacing on ended 0.4 s inside its bound (docs/benchmarks.md#the-real-launcher)
    train_s: float = 5.0
    timeout_s: float = 300.0  # the run stops here, all groups served or not


@dataclasses.dataclass
class Outcome:
    """What one run saw, through the real processes and the launcher's database."""

    pacing: str
    params: Params
    job: str
    elapsed_s: float  # from /start_rollout to the end of the run
    wall_s: float | None  # from /start_rollout to the trainer's last step; None if not all served
    served_s: float | None  # from /start_rollout to the last group served
    served: dict[str, list[list[dict[str, Any]]]]  # group -> the item lists it came in
    listed: dict[str, set[str]]  # group -> its sessions, as the launcher listed them
    terminal: set[str]  # sessions with a terminal row
    stats: dict[str, Any]
    admission: list[tuple[float, dict[str, Any]]]  # (seconds since start, /admission)
    calls: list[dict[str, Any]]  # the stand-in's, times since start
    clears: list[Any]
    polls: int
    empty_polls: int
    steps: int
    launcher: dict[str, Any]  # /health's launcher summary at the end
    workdir: Path

    @property
    def all_served(self) -> bool:
        return self.wall_s is not None

    def drops(self) -> dict[str, int]:
        """Groups dropped, by reason (``/stats``)."""
        by = self.stats.get("groups", {}).get("dropped") or {}
        return {str(r): int(n) for r, n in by.items() if n}

    def held(self) -> dict[str, Any]:
        """The gate's held first calls over the run, from ``/admission`` sampled every
        ADMISSION_EVERY_S: the most held at once, how many calls were held (the held count's
        rises from one sample to the next: a call held and let go between two samples is
        missed), the call-seconds held and their mean per call, the first and last time any was
        held, and how many were still held at the end. Empty when the gate publishes no held
        count."""
        counted = [(t, n) for t, doc in self.admission if (n := held_count(doc)) is not None]
        if not counted:
            return {}
        when = [t for t, n in counted if n]
        counts = [0] + [n for _t, n in counted]
        calls = sum(max(0, n - before) for before, n in itertools.pairwise(counts))
        call_s = sum(n for _t, n in counted) * ADMISSION_EVERY_S
        return {
            "max": max(n for _t, n in counted),
            "calls": calls,
            "mean_s": round(call_s / calls, 1) if calls else None,
            "call_s": round(call_s, 1),
            "first_s": round(when[0], 1) if when else None,
            "last_s": round(when[-1], 1) if when else None,
            "at_end": counted[-1][1],
        }

    def figures(self) -> dict[str, Any]:
        """The figures for docs/benchmarks.md."""
        sessions = {s for members in self.listed.values() for s in members}
        return {
            "pacing": self.pacing,
            "groups": len(self.listed),
            "served": len(self.served),
            "dropped": self.drops(),
            "sessions": len(sessions),
            "sessions_without_result": len(sessions - self.terminal),
            "model_calls": len(self.calls),
            "held": self.held(),
            "wall_s": None if self.wall_s is None else round(self.wall_s, 1),
            "served_s": None if self.served_s is None else round(self.served_s, 1),
            "elapsed_s": round(self.elapsed_s, 1),
            "polls": self.polls,
            "empty_polls": self.empty_polls,
            "steps": self.steps,
        }


def held_count(doc: dict[str, Any]) -> int | None:
    """First calls the gate holds now, as ``/admission`` says (None when it does not)."""
    gate = doc.get("gate")
    for where in (gate if isinstance(gate, dict) else {}, doc):
        value = where.get("held_calls")
        if isinstance(value, int):
            return value
    return None


def write_env_config(workdir: Path, params: Params) -> Path:
    """The math500_text env config: a dataset of ``groups`` problems and a runtime yaml with
    ``max_turns`` (the launcher makes K sessions of each line: one group each)."""
    dataset = workdir / "problems.jsonl"
    with dataset.open("w") as out:
        for i in range(params.groups):
            a, b = 3 + i, 40 + 7 * i
            doc = {"problem": f"Compute {a}+{b}.", "answer": str(a + b), "unique_id": f"p{i}"}
            out.write(json.dumps(doc) + "\n")
    runtime = workdir / "math500_runtime.yaml"
    runtime.write_text(f"max_turns: {params.max_turns}\nsystem_prompt: Answer briefly.\n")
    config = workdir / "math500_env.yaml"
    config.write_text(
        "environments:\n"
        "  - env_name: math500_text\n"
        "    env_num: 1\n"
        f"    dataset: {json.dumps(str(dataset))}\n"
        "    env_params:\n"
        f"      config_path: {json.dumps(str(runtime))}\n"
    )
    return config


def service_env(
    upstream: Upstream, params: Params, workdir: Path, pacing: bool, llm_port: int
) -> dict[str, str]:
    """The service's environment: the upstream launcher, on SQLite, its calls to the stand-in
    (through the gate with pacing on)."""
    path = os.pathsep.join(p for p in (str(upstream.python.parent), os.environ.get("PATH")) if p)
    return clean_env(
        {
            "PATH": path,  # `python3` in the service's launcher command: the launcher's venv
            "AIEVOBOX_ROOT": str(upstream.tree),
            "ROLLOUT_BUFFER_LAUNCHER": "aievobox",
            "AIEVOBOX_DB_URL": "sqlite://" + str(workdir / "launcher.db"),
            "AIEVOBOX_RUN_DIR": str(workdir / "logs"),
            "AIEVOBOX_ENV_CONFIG": str(write_env_config(workdir, params)),
            "AIEVOBOX_ENV_TRANSPORT": "inproc",
            "AIEVOBOX_POOL_SIZE": str(params.pool),
            "LLM_PROXY_HOST": "127.0.0.1",
            "LLM_PROXY_PORT": str(llm_port),
            "ROLLOUT_BUFFER_PACING": "gate" if pacing else "off",
            "ROLLOUT_BUFFER_GATE_PORT": str(free_port()),
            # a {} poller states no batch size: its operator says it (docs/pacing.md)
            **(
                {"ROLLOUT_BUFFER_PACING_BATCH_GROUPS": str(params.batch_groups)}
                if params.tell_batch_groups
                else {}
            ),
            "ROLLOUT_BUFFER_STOP_GRACE_SECONDS": "5",
        },
        package_parent=str(ROOT),
    )


class Sampler(threading.Thread):
    """GET /admission every ADMISSION_EVERY_S until stopped."""

    def __init__(self, url: str, started: float) -> None:
        super().__init__(name="admission-sampler", daemon=True)
        self.url, self.started = url, started
        self.samples: list[tuple[float, dict[str, Any]]] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        session = requests.Session()
        while not self.stopping.wait(ADMISSION_EVERY_S):
            try:
                doc = session.get(self.url + "/admission", timeout=10).json()
            except (requests.RequestException, ValueError):
                continue
            self.samples.append((time.monotonic() - self.started, doc))


def listed_groups(db_url: str, job: str) -> tuple[dict[str, set[str]], set[str]]:
    """The launcher's groups with their sessions (job_environments), and the sessions with a
    terminal row."""
    db = connect(db_url)
    try:
        rows = db.rows("SELECT env_id, group_id FROM job_environments WHERE job_id = ?", (job,))
        ended = db.rows(
            "SELECT DISTINCT session_id FROM session_steps WHERE job_id = ? AND is_terminal = 1",
            (job,),
        )
    finally:
        db.close()
    groups: dict[str, set[str]] = collections.defaultdict(set)
    for env_id, group_id in rows:
        groups[str(group_id)].add(str(env_id))
    return dict(groups), {str(s) for (s,) in ended}


def listed_so_far(db_url: str, job: str) -> dict[str, set[str]]:
    """The launcher's groups, or none while it has not made its tables yet."""
    try:
        return listed_groups(db_url, job)[0]
    except StorageError:
        return {}


def run(upstream: Upstream, params: Params, pacing: bool, workdir: Path) -> Outcome:
    """One run: start the service, /start_rollout, poll as the upstream client until every
    group the launcher listed was served or ``timeout_s`` passed; then read what happened."""
    workdir.mkdir(parents=True, exist_ok=True)
    job = "realstack_" + ("on" if pacing else "off")
    db_url = "sqlite://" + str(workdir / "launcher.db")
    with FakeLLM(delay_s=params.latency_s, clear_status=200) as llm:
        port = free_port()
        env = service_env(upstream, params, workdir, pacing, llm.port)
        server = ServerProcess(port, env, str(workdir / "server.log"), cwd=str(workdir))
        server.spawn()
        url = f"http://127.0.0.1:{port}"
        try:
            problem = server.wait_healthy(60)
            if problem is not None:
                raise RuntimeError(
                    f"the service did not start: {problem}\n{log_tail(server.log_path)}"
                )
            outcome = _drive(url, llm, params, pacing, job, db_url, workdir)
        finally:
            server.stop()
    return outcome


def _drive(
    url: str, llm: FakeLLM, params: Params, pacing: bool, job: str, db_url: str, workdir: Path
) -> Outcome:
    http = requests.Session()
    started = time.monotonic()
    answer = http.post(
        url + "/start_rollout",
        json={"num_repeat_per_sample": params.k, "job_session": job},
        timeout=120,
    )
    if answer.status_code != 200:  # the launcher could not start, or exited at once: its log says
        raise RuntimeError(f"/start_rollout answered {answer.status_code}: {answer.text}")
    sampler = Sampler(url, started)
    sampler.start()
    trainer = Trainer(url, llm, params, started)
    listed: dict[str, set[str]] = {}

    def all_served() -> bool:
        """Every group of the dataset listed (the launcher lists them in batches) and served."""
        return len(listed) >= params.groups and set(listed) <= set(trainer.served)

    try:
        while not trainer.out_of_time() and not trainer.nothing_more:
            if len(listed) < params.groups:
                listed = listed_so_far(db_url, job)
            if all_served() and not trainer.buffered:
                break  # every group served and trained on
            if trainer.buffered >= params.batch_groups or all_served():
                trainer.train()  # (the last step takes what is left)
            else:
                trainer.fetch()
        elapsed = time.monotonic() - started
        health = http.get(url + "/health", timeout=30).json()
        done = all_served()
        deadline = time.monotonic() + 30  # a launcher that made every group is on its way out
        while (
            done and (health.get("launcher") or {}).get("running") and time.monotonic() < deadline
        ):
            time.sleep(0.2)
            health = http.get(url + "/health", timeout=30).json()
        stats = http.get(url + "/stats", timeout=30).json()
    finally:
        sampler.stopping.set()
        sampler.join(15)
    complete = all_served()
    listed, terminal = listed_groups(db_url, job)
    return Outcome(
        pacing="gate" if pacing else "off",
        params=params,
        job=job,
        elapsed_s=elapsed,
        wall_s=trainer.trained_s if complete and set(listed) <= set(trainer.served) else None,
        served_s=trainer.last_group_s,
        served=dict(trainer.served),
        listed=listed,
        terminal=terminal,
        stats=stats,
        admission=sampler.samples,
        calls=[
            {**c, "arrived": c["arrived"] - started, "answered": c["answered"] - started}
            for c in llm.calls
        ],
        clears=list(llm.clears),
        polls=trainer.polls,
        empty_polls=trainer.empty_polls,
        steps=trainer.steps,
        launcher=health.get("launcher") or {},
        workdir=workdir,
    )


class Trainer:
    """The upstream client (Safactory ``rl/slime_generator.py``) as it polls: a step needs
    ``batch_groups`` groups; until it has them, it sleeps ``fetch_sleep_s`` and fetches, and a
    fetch polls ``{}`` until ``success`` is true, sleeping ``empty_sleep_s`` after each empty
    answer. Then it trains ``train_s`` and the policy moves on (the stand-in stamps the next
    version)."""

    def __init__(self, url: str, llm: FakeLLM, params: Params, started: float) -> None:
        self.url, self.llm, self.params, self.started = url, llm, params, started
        self.http = requests.Session()
        self.served: dict[str, list[list[dict[str, Any]]]] = collections.defaultdict(list)
        self.buffered = 0  # groups taken and not yet trained on
        self.polls = self.empty_polls = self.steps = 0
        self.last_group_s: float | None = None  # when the last group so far was served
        self.trained_s: float | None = None  # when the last step so far ended
        self.nothing_more = False  # the launcher is gone and the service has nothing left

    def launcher_gone(self) -> bool:
        """The launcher exited, every row it wrote was read, and no group is left to serve:
        nothing more can come (a launcher that failed ends the run at once)."""
        stats = self.http.get(self.url + "/stats", timeout=30).json()
        launcher, groups = stats.get("launcher") or {}, stats.get("groups") or {}
        return (
            launcher.get("running") is False
            and launcher.get("exit_code") is not None
            and stats.get("lag_rows") == 0
            and not any(groups.get(key) for key in ("pending", "ready", "in_flight"))
        )

    def out_of_time(self) -> bool:
        return time.monotonic() - self.started >= self.params.timeout_s

    def fetch(self) -> None:
        """One fetch: its sleep first, then {} polls until a batch (or the run's time is up)."""
        time.sleep(self.params.fetch_sleep_s)
        while not self.out_of_time():
            self.polls += 1
            doc = self.http.post(self.url + "/get_rollout_data", json={}, timeout=120).json()
            if doc.get("success"):
                break
            self.empty_polls += 1
            if self.launcher_gone():
                self.nothing_more = True
                return
            time.sleep(self.params.empty_sleep_s)
        else:
            return
        for gid, items in _groups(doc["data"]["data"]).items():
            self.served[gid].append(items)
            self.buffered += 1
        self.last_group_s = time.monotonic() - self.started

    def train(self) -> None:
        """One step on B groups (or what is left at the end)."""
        time.sleep(self.params.train_s)
        self.buffered -= min(self.buffered, self.params.batch_groups)
        self.steps += 1
        self.llm.version += 1  # the new policy: the proxy stamps it from now on
        self.trained_s = time.monotonic() - self.started


def _groups(items: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """A batch's items by their group (``extra_info.group_id``)."""
    out: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for item in items:
        out[str(item["extra_info"]["group_id"])].append(item)
    return dict(out)
