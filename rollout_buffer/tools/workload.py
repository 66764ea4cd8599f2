"""The simulated workload: environments, prompt groups of K sessions, and text of a given size.

Owns the shapes the simulated launcher (simulate.py) fills in and writes as rows; it does no I/O.
``group_id`` is ``uuid5(NAMESPACE_OID, f"{env_name}:{task_idx}")``, as the real launcher derives it.

It must not do I/O or draw randomness of its own (the simulator hands it its seeded generator).
"""

from __future__ import annotations

import random
import uuid

ENV_NAMES = ("alfworld", "webshop", "sokoban", "math500", "textcraft", "osgym")
LLM_MODEL = "simulated"
SYSTEM_PROMPTS = {
    name: f"You are an agent acting in the {name} environment. Think step by step, then "
    f"reply with exactly one action in the form 'Action: <command>'."
    for name in ENV_NAMES
}
_VOCAB = [
    "the",
    "a",
    "to",
    "of",
    "and",
    "you",
    "see",
    "go",
    "take",
    "open",
    "room",
    "door",
    "key",
    "box",
    "table",
    "north",
    "south",
    "east",
    "west",
    "drawer",
    "shelf",
    "apple",
    "knife",
    "lamp",
    "put",
    "on",
    "in",
    "with",
    "from",
    "item",
    "price",
    "buy",
    "search",
    "click",
    "back",
    "next",
    "answer",
    "compute",
    "sum",
    "value",
    "step",
    "check",
    "look",
    "inventory",
    "café",
    "naïve",
    "数据",
    "环境",
    "→",
    "—",
]


class Text:
    """Cheap pseudo-natural text from a seeded generator."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def words(self, n_bytes: float) -> str:
        rng, out, size = self.rng, [], 0
        target = max(1, int(n_bytes))
        while size < target:
            w = rng.choice(_VOCAB)
            if rng.random() < 0.07:
                w += "."
            out.append(w)
            size += len(w.encode()) + 1
        return " ".join(out)


# How a simulated session ends (SPEC §2, what the real launcher writes):
DONE = "done"  # its environment ended it: a terminal row with the session's reward
LENGTH = "length"  # the model's answer was cut by its length limit: terminal, truncated, reward 0
CAPPED = "capped"  # it reached --max-steps first: no terminal row
FAILED = "failed"  # its environment or model call failed for good: aborted, no terminal row
ENDINGS = (DONE, LENGTH, CAPPED, FAILED)


class Session:
    __slots__ = (
        "cum_reward",
        "ending",
        "group",
        "history",
        "rows_planned",
        "session_id",
        "step",
        "terminal_reward",
    )

    def __init__(self, group: Group, session_id: str) -> None:
        self.group = group
        self.session_id = session_id
        self.history: list[dict[str, str]] = []
        self.step = 0
        self.rows_planned = 0
        self.ending = DONE
        self.terminal_reward = 0.0
        self.cum_reward = 0.0

    @property
    def completes(self) -> bool:
        """It writes a terminal (completed) row: its group can use it."""
        return self.ending in (DONE, LENGTH)


class Group:
    __slots__ = ("completed", "env_name", "group_id", "index", "sessions", "task", "task_idx")

    def __init__(self, index: int, task_idx: int) -> None:
        self.index = index
        self.task_idx = task_idx
        self.env_name = ENV_NAMES[task_idx % len(ENV_NAMES)]
        self.group_id = str(uuid.uuid5(uuid.NAMESPACE_OID, f"{self.env_name}:{task_idx}"))
        self.task = ""
        self.sessions: list[Session] = []
        self.completed = 0
