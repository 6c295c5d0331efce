"""SGLang's page keys, computed from tokens: how the other engines name a prefix as SGLang does.

An SGLang server's L3 calls name pages only by SGLang's own hash (never by tokens), so its pages can
be shared only if the other engines name theirs the same way. The hash is a public function of the
tokens (SGLang's `get_storage_hash_str`): SHA-256 over the previous page's digest (for the first page,
the namespace seed when the request carries a cache salt), then each token id as 4 bytes
little-endian unsigned. Declared as the `sglang` key scheme (`StoreConfig.key_scheme = "sglang"` or
`"sglang:<shard>"`): no SGLang import, only hashlib.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

from agentstate.errors import InvalidArgumentError
from agentstate.keys import ChunkKey, token_array

SGLANG_PAGE_PREFIX = "p/"
"""SGLang HiCache pages: `p/<fingerprint>/<page size>/<shard>/<SGLang page hash>` (adapters/sglang.py)."""
DEFAULT_SHARD = "pp0-1.cp0-1"
"""One pipeline and one context-parallel rank, as the SGLang adapter names its rank directories."""


def sglang_seed(extra_key: str | None, cache_salt: str | None) -> bytes | None:
    """The digest SGLang seeds a storage chain with (`storage_namespace_seed`): None when both are absent."""
    if extra_key is None and cache_salt is None:
        return None
    digest = hashlib.sha256(b"sglang-cache-namespace-v1")
    for part in (extra_key, cache_salt):
        if part is None:
            digest.update(b"\x00")
            continue
        encoded = part.encode("utf-8")
        digest.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return digest.digest()


def page_base(fingerprint: str, page_size: int, shard: str) -> str:
    """The keys' prefix before the page hash."""
    return f"{SGLANG_PAGE_PREFIX}{fingerprint}/{page_size}/{shard or DEFAULT_SHARD}/"


def sglang_page_keys(
    tokens: Sequence[int] | array, *, fingerprint: str, page_size: int, shard: str = DEFAULT_SHARD,
    salt: str | None = None,
) -> list[ChunkKey]:  # fmt: skip
    """The keys under which an SGLang server with agentstate as its L3 stores the full pages of `tokens`:
    anyone who has the tokens computes the keys SGLang will ask for, and SGLang asks for the keys anyone
    who had the tokens stored under."""
    packed = tokens if isinstance(tokens, array) else token_array(tokens)
    if packed and max(packed) >= 2**32:
        raise InvalidArgumentError("SGLang page keys hash token ids as 4-byte unsigned ints: an id is >= 2**32")
    words = array("I", packed)
    if sys.byteorder != "little":
        words.byteswap()
    raw = words.tobytes()
    prev = sglang_seed(None, salt)
    step, base = page_size * 4, page_base(fingerprint, page_size, shard)
    keys: list[ChunkKey] = []
    for start in range(0, (len(packed) // page_size) * step, step):
        prev = hashlib.sha256((prev or b"") + raw[start : start + step]).digest()
        keys.append(ChunkKey(f"{base}{prev.hex()}"))
    return keys
