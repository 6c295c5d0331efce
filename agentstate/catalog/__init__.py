"""Sessions' catalogs: the `Catalog` interface, `LMDBCatalog` (local, the default) and
`RedisCatalog` (shared by every host; needs the `remote` extra, loaded only when asked for)."""

from __future__ import annotations

from typing import Any

from agentstate.catalog.base import Catalog, Committed, kv_keys, named_keys
from agentstate.catalog.lmdb import CATALOG_FORMAT, LMDBCatalog

__all__ = ["CATALOG_FORMAT", "Catalog", "Committed", "LMDBCatalog", "RedisCatalog", "kv_keys", "named_keys"]


def __getattr__(name: str) -> Any:
    if name == "RedisCatalog":
        from agentstate.catalog.redis import RedisCatalog

        return RedisCatalog
    raise AttributeError(name)
