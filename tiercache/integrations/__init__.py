"""Integrations with the libraries that hold KV caches. Each module imports its library only
when it is imported itself:

- :mod:`.transformers`: :class:`~tiercache.integrations.transformers.TieredCache`, a Hugging
  Face ``transformers`` ``Cache`` whose KV lives in tiercache blocks (``pip install
  tiercache[hf]``).
"""
