"""``python -m rollout_buffer`` runs the command line interface.

Owns: nothing but handing ``python -m rollout_buffer`` to :func:`rollout_buffer.cli.main`; it must
not hold logic of its own.
"""
import sys

from .cli import main

sys.exit(main())
