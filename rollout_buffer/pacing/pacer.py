"""Pacing as the service sees it: the budget, the gate, where the gate listens, and the route of
the launcher's model calls.

Owns: the gate's address (the configured one, or the one in the running launcher's
``--llm-base-url``: an adopted launcher keeps calling where it was told), the launcher's route
through the gate, and ``GET /admission``. It must not read the accumulator: it follows the changes
the composition root feeds it (:meth:`Pacing.publish`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from rollout_buffer.core.config import Config
from rollout_buffer.core.errors import OperationFailed
from rollout_buffer.core.hosts import is_loopback
from rollout_buffer.core.redact import hide
from rollout_buffer.launcher.command import ModelRoute
from rollout_buffer.pacing.budget import Budget
from rollout_buffer.pacing.gate import Address, Gate, Limits

WILDCARDS = ("", "0.0.0.0", "::")
ROUTE_WAIT_S = 3.0  # a launcher started just after the service waits this long for the gate


class Pacing:
    """The budget and its gate; ``owner()`` says whether this instance owns the job, and
    ``launcher_url()`` gives the running launcher's ``--llm-base-url`` (None: none runs)."""

    def __init__(
        self,
        config: Config,
        *,
        owner: Callable[[], bool],
        launcher_url: Callable[[], str | None],
    ) -> None:
        assert config.proxy_host is not None and config.proxy_port is not None  # (Config checks)
        self.config = config
        self.owner = owner
        self.launcher_url = launcher_url
        if config.gate_secret:
            hide(config.gate_secret)
        self.budget = Budget(
            staleness=config.pacing_staleness,
            max_off_policy=config.max_off_policy,
            batch_groups=config.pacing_batch_groups,
            session_timeout_s=config.pacing_session_timeout_s,
        )
        limits = Limits(
            max_body_bytes=config.gate_max_body_bytes,
            stall_s=config.gate_stall_s,
            max_held_bytes=config.gate_max_held_bytes,
            max_hold_s=config.gate_max_hold_s,
        )
        self.gate = Gate(
            self.budget,
            limits,
            upstream=(config.proxy_host, config.proxy_port),
            address=self.address,
            owner=owner,
        )

    def start(self) -> None:
        self.gate.start()

    def close(self) -> None:
        self.gate.close()

    # -- what it is told (any thread) -----------------------------------------------------------
    def publish(self, event: tuple[Any, ...]) -> None:
        """A change of the job (an accumulator's, under its lock), or a poll: quick, no lock."""
        self.budget.publish(event)
        self.gate.poke()

    # -- where the gate listens -----------------------------------------------------------------
    def configured(self) -> Address:
        c = self.config
        host = c.gate_host
        if host in WILDCARDS:  # the launcher reaches it by the advertised name, else locally
            advertised = urlsplit(c.advertise_url or "").hostname
            host = advertised or "127.0.0.1"
        shown = f"[{host}]" if ":" in host else host
        base = f"/{c.gate_secret}/v1" if c.gate_secret else "/v1"
        return Address(c.gate_host, c.gate_port or c.port + 1, shown, base)

    def address(self) -> Address:
        """The configured address, or the one the running launcher calls (a launcher adopted from
        another instance on this host keeps its URL: its port, its secret)."""
        configured = self.configured()
        url = self.launcher_url()
        if not url:
            return configured
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            return configured
        proxy = (self.config.proxy_host, self.config.proxy_port)
        if (
            parts.scheme != "http"
            or not parts.hostname
            or port is None
            or (parts.hostname, port) == proxy
            or not parts.path.endswith("/v1")
        ):
            return configured  # not a gate's URL (pacing was off when it started)
        secret = parts.path[: -len("/v1")].strip("/")
        if secret:
            hide(secret)
        elif not is_loopback(configured.bind):
            return configured  # beyond loopback the gate never listens without a secret
        host = parts.netloc.rsplit(":", 1)[0]
        return Address(configured.bind, port, host, parts.path)

    def route(self) -> ModelRoute:
        """The launcher's model calls through the gate; OperationFailed while it cannot listen
        (a launcher must never call a port that another process holds)."""
        deadline = time.monotonic() + ROUTE_WAIT_S
        while (url := self.gate.url()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if url is None:
            address = self.configured()
            raise OperationFailed(
                f"the pacing gate does not listen on {address.bind}:{address.port} "
                f"({self.gate.bind_error or 'not the owner'}): the launcher is not started; "
                "free the port or set ROLLOUT_BUFFER_GATE_PORT"
            )
        # AIEVOBOX_LLM_MAX_CONCURRENCY=0: held first calls would keep the launcher's semaphore
        # slots and deadlock its running sessions (SPEC §5); the gate paces by group instead
        return ModelRoute(url, {"AIEVOBOX_LLM_MAX_CONCURRENCY": "0"}, ("--llm-calls",))

    # -- GET /admission ---------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        with self.budget.lock:
            self.budget.read_inbox()
            doc = self.budget.report()
            why = self.gate.why()
        return {
            "pacing": "gate",
            **doc,
            "why": why,
            "gate": self.gate.stats(),
            "refused": dict(self.gate.refused),
        }
