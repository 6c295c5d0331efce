"""Engine adapters (transformers, sglang, vllm), installed as `agentstate.adapters`.

Each adapter converts an engine's native KV layout to and from canonical KV. They are imported
lazily by name, so `import agentstate` never pulls in an engine.

What the core must know of an adapter without importing it, each declares here (`agentstate.edges`):
its config-file table, and the keys it stores outside the catalog. The core names no engine.
"""

from agentstate.edges import Edge, KeySpace, declare

SGLANG_PAGES = KeySpace("p/", report="sglang_pages", label="SGLang HiCache pages")
"""SGLang's HiCache pages (adapters/sglang.py): `p/<fingerprint>/<page size>/<shard>/<SGLang page key>`,
under SGLang's page hashes (its own index), never named by a manifest."""
SGLANG = declare(Edge("sglang", key_spaces=(SGLANG_PAGES,)))
VLLM = declare(Edge("vllm"))
"""The vLLM connector stores agentstate chunks and sessions only; its config-file table is `[vllm]`."""
