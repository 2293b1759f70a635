"""transformers integration: ``PagedCache`` (a ``Cache`` over a pool's blocks) and ``Engine``
(continuous batching over a pool).

Importing this module imports transformers (the ``hf`` extra).
"""

from kvdaemon.integrations.hf_cache import PagedCache
from kvdaemon.integrations.hf_engine import Engine, kv_spec_for
from kvdaemon.integrations.request import Request

__all__ = ["Engine", "PagedCache", "Request", "kv_spec_for"]
