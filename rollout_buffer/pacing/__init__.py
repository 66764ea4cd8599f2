"""Pacing the producers (issue 34): the admission budget and the gate that enforces it.

Only the composition root (:mod:`rollout_buffer.service`) imports this package, and only with
``ROLLOUT_BUFFER_PACING=gate``: pacing off builds nothing of it. Its one dependency, h11, is the
``pacing`` extra.

Owns: building pacing. It must not be imported by core, storage, launcher, serving or runtime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rollout_buffer.core.errors import ConfigError

if TYPE_CHECKING:
    from rollout_buffer.pacing.pacer import Pacing


def build(config: Any, **wiring: Any) -> Pacing:
    """Pacing for ``config``; a ConfigError naming the extra when h11 is missing."""
    try:
        import h11  # noqa: F401  (the extra's one package: checked before anything starts)
    except ImportError:
        raise ConfigError(
            "ROLLOUT_BUFFER_PACING=gate needs the pacing extra: "
            "pip install 'rollout-buffer[pacing]'"
        ) from None
    from rollout_buffer.pacing.pacer import Pacing

    return Pacing(config, **wiring)
