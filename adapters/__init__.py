"""Engine adapters (transformers, sglang, vllm), installed as `agentstate.adapters`.

Each adapter converts an engine's native KV layout to and from canonical KV. They are imported
lazily by name, so `import agentstate` never pulls in an engine.

What the core must know of an adapter without importing it, each declares here (`agentstate.edges`):
its config-file table, and the keys it stores outside the catalog. The core names no engine.
"""

from agentstate.adapters.sglang_keys import DEFAULT_SHARD, page_base, sglang_page_keys
from agentstate.edges import Edge, KeyScheme, KeySpace, declare

SGLANG_PAGES = KeySpace("p/", report="sglang_pages", label="SGLang HiCache pages")
"""SGLang's HiCache pages (adapters/sglang.py): `p/<fingerprint>/<page size>/<shard>/<SGLang page key>`,
under SGLang's page hashes (its own index), never named by a manifest."""
SGLANG_KEYS = KeyScheme(
    "sglang",
    keys=lambda tokens, fingerprint, chunk_tokens, shard, salt: list(
        sglang_page_keys(tokens, fingerprint=fingerprint, page_size=chunk_tokens, shard=shard or DEFAULT_SHARD, salt=salt)
    ),
    base=lambda fingerprint, chunk_tokens, shard: page_base(fingerprint, chunk_tokens, shard),
)
"""Shared prefixes keyed as SGLang keys its pages (adapters/sglang_keys.py): `key_scheme = "sglang"` (or
`"sglang:<shard>"`), a chunk being one page, so that SGLang servers and the other engines share them."""
SGLANG = declare(Edge("sglang", key_spaces=(SGLANG_PAGES,), key_schemes=(SGLANG_KEYS,)))
VLLM = declare(Edge("vllm"))
"""The vLLM connector stores agentstate chunks and sessions only; its config-file table is `[vllm]`."""
