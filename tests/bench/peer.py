#!/usr/bin/env python3
"""rollout-buffer as a benchmark peer for ../shared/bench/bench.py (the interface of
peer_original.py).

    tests/bench/peer.py start --port P --db DB --job JOB --k K --workdir DIR
    tests/bench/peer.py stop PID

``start`` starts the recording fake LLM proxy of ../shared/bench and ``python -m rollout_buffer
serve`` (gunicorn, one gthread worker) in one new process group, with the original's
environment variables: the DB, the proxy, a run dir in the workdir, and an AIEVOBOX_ROOT
holding a copy of the benchmark's stand-in launcher.py (it records its argv and idles). It
waits for GET /health, sends POST /start_rollout {"num_repeat_per_sample": K, "job_session":
JOB, "restart_training": false}, waits for the stand-in launcher's marker file, and prints
PID= (the group leader: the gunicorn master), URL=, MEM_PIDS= (master and worker), LOG=,
APP_LOG= and PROXY_RECORD=. ``stop PID`` TERMs the group, waits, KILLs what is left.
Stdlib only; the service runs on this interpreter (it needs the project's requirements).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BENCH = os.environ.get("BENCH_DIR", os.path.join(os.path.dirname(ROOT), "shared", "bench"))
sys.path.insert(0, ROOT)
from rollout_buffer.launcher import procfs  # noqa: E402  (stdlib only: works under any interpreter)


def die(msg: str) -> None:
    print(f"peer: {msg}", file=sys.stderr)
    sys.exit(1)


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, obj=None, timeout: float = 10.0):
    data = None if obj is None else json.dumps(obj).encode()
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.status, resp.read()


def tail(path: str, n: int = 40) -> str:
    try:
        with open(path, "rb") as fh:
            return "\n".join(fh.read().decode("utf-8", "replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


children = procfs.children
group_members = procfs.group_members


def server_env(
    args: argparse.Namespace, db: str, root: str, run_dir: str, proxy_port: int
) -> dict[str, str]:
    """The service's environment: ours without any of its settings, the peer's, then RB_PEER_ENV
    and --env."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ROLLOUT_BUFFER_", "AIEVOBOX_", "LLM_PROXY_")) and k != "RB_PEER_ENV"
    }
    env.update(
        {
            "BUFFER_SERVER_PORT": str(args.port),
            "ROLLOUT_BUFFER_HOST": "127.0.0.1",
            "STORAGE_TYPE": "sqlite",
            "AIEVOBOX_DB_URL": "sqlite://" + db,
            "LLM_PROXY_HOST": "127.0.0.1",
            "LLM_PROXY_PORT": str(proxy_port),
            "AIEVOBOX_RUN_DIR": run_dir,
            "AIEVOBOX_ROOT": root,
            "AIEVOBOX_ENV_ROOT": os.path.join(root, "env"),
            "PYTHONUNBUFFERED": "1",
            "BENCH_LAUNCHER_MODE": "sleep",
            # the AIEvoBox launcher command is `python3 launcher.py`: resolve it to this interpreter
            "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
            "PYTHONPATH": ROOT
            + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""),
        }
    )
    # RB_PEER_ENV="KEY=VALUE ..." in the peer's own environment: per-peer settings in one bench.py
    # run, which --peer-arg (the same for every peer) cannot give:
    #   --peer "on=env RB_PEER_ENV='ROLLOUT_BUFFER_OVERSAMPLE=1' python3 tests/bench/peer.py"
    for kv in shlex.split(os.environ.get("RB_PEER_ENV", "")) + args.env:
        key, sep, value = kv.partition("=")
        if not sep:
            die(f"--env expects KEY=VALUE, got {kv!r}")
        env[key] = value
    return env


def cmd_start(args: argparse.Namespace) -> int:
    if port_in_use(args.port):
        die(f"port {args.port} is already in use")
    db = os.path.abspath(args.db)
    if not os.path.exists(db):
        die(f"database {db} does not exist")
    workdir = os.path.abspath(args.workdir or f"/tmp/rollout-buffer-peer/{args.port}")
    if os.path.isdir(workdir):
        shutil.rmtree(workdir)
    run_dir = os.path.join(workdir, "run")
    root = os.path.join(workdir, "aievobox")
    os.makedirs(os.path.join(root, "env"), exist_ok=True)
    os.makedirs(run_dir, exist_ok=True)
    shutil.copy(
        os.path.join(BENCH, "originalpeer", "launcher.py"), os.path.join(root, "launcher.py")
    )
    log_path = os.path.join(workdir, "server.out")
    proxy_record = os.path.join(workdir, "proxy_calls.jsonl")
    proxy_port_file = os.path.join(workdir, "proxy.port")
    proxy_port = free_port()

    env = server_env(args, db, root, run_dir, proxy_port)
    proxy_cmd = [
        sys.executable,
        os.path.join(BENCH, "fake_proxy.py"),
        "--port",
        str(proxy_port),
        "--record",
        proxy_record,
        "--port-file",
        proxy_port_file,
    ]
    server_cmd = [sys.executable, "-m", "rollout_buffer", "serve"]
    shell = "{} >{} 2>&1 </dev/null & exec {}".format(
        " ".join(map(shlex.quote, proxy_cmd)),
        shlex.quote(os.path.join(workdir, "proxy.out")),
        " ".join(map(shlex.quote, server_cmd)),
    )
    with open(log_path, "wb") as out:
        server = subprocess.Popen(
            ["/bin/sh", "-c", shell],
            cwd=workdir,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def fail(msg: str) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        die(f"{msg}\n--- {log_path} (tail) ---\n{tail(log_path)}")

    url = f"http://127.0.0.1:{args.port}"
    deadline = time.monotonic() + args.timeout
    while True:
        if server.poll() is not None:
            fail(f"server exited with code {server.returncode} during startup")
        try:
            if http("GET", url + "/health", timeout=2)[0] == 200:
                break
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            fail(f"server did not answer on {url} within {args.timeout} s")
        time.sleep(0.05)
    try:
        _status, _body = http(
            "POST",
            url + "/start_rollout",
            {
                "num_repeat_per_sample": args.k,
                "job_session": args.job,
                "restart_training": args.restart_training,
            },
            30,
        )
    except urllib.error.HTTPError as exc:
        fail(f"/start_rollout answered {exc.code}: {exc.read()[:300]!r}")
    marker = os.path.join(run_dir, "launcher.json")
    while not os.path.exists(marker):
        if time.monotonic() > deadline:
            fail("the stand-in launcher did not start")
        time.sleep(0.05)

    def is_proxy(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                return b"fake_proxy.py" in fh.read()
        except OSError:
            return False

    workers = [
        p for p in children(server.pid) if not is_proxy(p)
    ]  # the gunicorn worker, not the proxy
    print(f"PID={server.pid}")
    print(f"URL={url}")
    print(f"MEM_PIDS={','.join(str(p) for p in [server.pid, *workers])}")
    print(f"LOG={log_path}")
    print(f"APP_LOG={os.path.join(run_dir, 'rollout_buffer.log')}")
    print(f"PROXY_RECORD={proxy_record}")
    print(f"WORKDIR={workdir}")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    try:
        os.killpg(args.pid, signal.SIGTERM)
    except ProcessLookupError:
        print(f"process group {args.pid} is already gone")
        return 0
    deadline = time.monotonic() + args.timeout
    while group_members(args.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = group_members(args.pid)
    if left:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(args.pid, signal.SIGKILL)
        while group_members(args.pid) and time.monotonic() < deadline + 5:
            time.sleep(0.05)
        print(f"stopped {args.pid}; SIGKILL sent to {left}")
    else:
        print(f"stopped {args.pid}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description="rollout-buffer as a bench.py peer",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--db", required=True)
    s.add_argument("--job", required=True)
    s.add_argument("--k", type=int, required=True)
    s.add_argument("--workdir")
    s.add_argument("--restart-training", action="store_true")
    s.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="extra server environment"
    )
    s.add_argument("--timeout", type=float, default=60.0)
    s.set_defaults(func=cmd_start)
    t = sub.add_parser("stop")
    t.add_argument("pid", type=int)
    t.add_argument("--timeout", type=float, default=20.0)
    t.set_defaults(func=cmd_stop)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
