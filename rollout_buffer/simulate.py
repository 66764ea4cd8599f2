"""``python -m rollout_buffer.simulate``: the simulated launcher's public command.

The service starts the simulated launcher with this path, and operators and the docs use it, so it
stays stable while the code lives in :mod:`rollout_buffer.tools.simulate`.
"""

from __future__ import annotations

import sys

from rollout_buffer.tools.simulate import main

if __name__ == "__main__":
    sys.exit(main())
