"""WSGI entry point: ``gunicorn wsgi:app`` (the repository's gunicorn.conf.py pins 1 worker)."""

from rollout_buffer.web.app import create_app

app = create_app()
