"""transformers integration: ``PagedCache``, a ``Cache`` over a ``KVPool``'s blocks.

Importing this module imports transformers (the ``hf`` extra).
"""

from kvdaemon.integrations.hf_cache import PagedCache

__all__ = ["PagedCache"]
