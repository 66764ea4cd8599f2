"""rollout-buffer: groups agentic RL rollout steps from the launcher's database and serves
complete prompt groups to the trainer over HTTP.

Owns: the version and a lazy ``create_app`` re-export. It must not import anything at import time:
the command line, the simulator and the benchmark peer import the package without Flask.
"""

from __future__ import annotations

__version__ = "0.1.0"


def create_app(config=None):
    """Build the Flask app (see :func:`rollout_buffer.web.app.create_app`)."""
    from rollout_buffer.web.app import create_app as _create_app

    return _create_app(config)


__all__ = ["__version__", "create_app"]
