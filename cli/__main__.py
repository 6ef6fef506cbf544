"""``python -m tiercache.cli``: the ``tiercache`` command (where the script is not on PATH)."""

from .app import main

main()
