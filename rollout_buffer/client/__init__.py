"""A trainer-side client for rollout-buffer (and for the original buffer server where features
overlap), blocking or asyncio.

Typical use in a trainer::

    from rollout_buffer.client import BufferClient

    client = BufferClient("http://buffer-host:18889", token=os.environ.get("ROLLOUT_BUFFER_TOKEN"))
    client.start_rollout(num_repeat_per_sample=8, job_session="run-42")
    batch = client.get_batch(min_groups=64)
    for group in batch.groups:
        rewards = [session.reward for session in group.sessions]

:class:`AsyncBufferClient` has the same constructor and methods as coroutines (``async with``,
``await client.get_batch(...)``, ``async for group in client.iter_groups(...)``). See
``docs/client.md``.

Delivery contract (SPEC section 4): every logical ``get_rollout_data`` call carries one fresh
``request_id`` that is reused only for that call's retries: a response lost in transit is
replayed, not lost. The original server has no request_id: pass ``use_request_id=False``.

Errors: a 4xx answer raises :class:`BufferError` (with ``.status`` and the server's message);
connection errors, timeouts and 5xx answers are retried with exponential backoff (honouring
``Retry-After``) for ``retry_window_s`` (120 s: a restart or a takeover), and
:class:`BufferUnavailable` is raised then. For a poll, both carry its ``request_id``: the
client's next poll resumes it by itself, and ``get_batch(request_id=...)`` from another client,
so a batch the service served while its answer was lost still reaches the trainer.

Failover (issue 12): give it every instance's URL (a list, or one string with commas). A standby
answers 307 with the owner's URL: the client follows it itself (requests would drop the
Authorization header on a redirect to another host), with the same method, body and request_id,
and goes to the owner first from then on. A URL that refuses the connection is left for the next
one at once; a retried request_id is replayed by whichever instance owns the job by then.

Owns: the trainer's side of the HTTP contract. It must not import the service or talk to a
database (an import-linter contract): it speaks HTTP only, with ``requests`` and the stdlib.
"""

from rollout_buffer.client.asynchronous import AsyncBufferClient
from rollout_buffer.client.blocking import BufferClient
from rollout_buffer.client.transport import BufferError, BufferUnavailable
from rollout_buffer.client.views import Batch, Group, Session, groups_of

__all__ = [
    "AsyncBufferClient",
    "Batch",
    "BufferClient",
    "BufferError",
    "BufferUnavailable",
    "Group",
    "Session",
    "groups_of",
]
