"""gunicorn loads ./gunicorn.conf.py by default: plain `gunicorn wsgi:app` gets the safe
settings."""

from rollout_buffer.web.gunicorn_conf import *  # noqa: F403
