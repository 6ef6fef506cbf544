"""The ``tiercache`` command line (typer): ``tiercache --help``."""

from .app import app, main

__all__ = ["app", "main"]
