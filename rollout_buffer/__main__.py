"""``python -m rollout_buffer`` runs the command line interface.

Owns: nothing but handing ``python -m rollout_buffer`` to :func:`rollout_buffer.tools.cli.main`; it
must not hold logic of its own."""

import sys

from rollout_buffer.tools.cli import main

sys.exit(main())
