"""vLLM KV connector on an agentstate store, loaded from this module by vLLM's connector factory::

    --kv-transfer-config '{"kv_connector": "AgentStateConnector",
      "kv_connector_module_path": "agentstate.adapters.vllm", "kv_role": "kv_both",
      "kv_connector_extra_config": {"path": "/data/kv"}}'

`{"path": DIR}` alone is the embedded default (host tier over LMDB in DIR). Other keys: `model_id`,
`revision`, `timeout_s`, `lookup_timeout_s`, `config_file` (a JSON file of StoreConfig fields), and
any StoreConfig field (`tiers`, `tenant`, `chunk_tokens`, `catalog_url`, ...), as for the SGLang
adapter. With tensor or pipeline parallelism each rank has its own directory below DIR.

How it runs. vLLM makes one instance per role. The WORKER instance (in the process that owns the
KV blocks) opens the store and owns it: a data directory has one writer. The SCHEDULER instance
(vLLM's EngineCore, another process on CPU) computes agentstate's chunk keys over a prompt's
token ids (cache_salt, where set, is the tenant namespace) and asks the worker, over a Unix socket,
how many leading chunks are stored (`lookup.py`). The socket is bound only by a worker
that opened the store (so holds the directory's lock) and is named after this engine (its KV
transfer engine id and config instance id), and every reply says whose it is: a scheduler only ever
counts hits its own worker can load. An engine whose worker cannot open the store (another process
holds the directory: an engine left running after its API server was killed) runs without it,
serving every prompt as a miss; the worker logs one line naming the holder's PID, the scheduler one
line that its worker serves no lookups. A load that failed is never offered as a hit again for that
request (it is recomputed). It reports whole chunks beyond
vLLM's own hit, leaving at least one prompt token to compute, as an asynchronous load: the
request waits while the worker's event loop copies each checked chunk straight into the
request's blocks (a KVTarget over the engine's registered caches), and other requests' forwards
go on. A chunk that is missing, corrupt or late is reported through
`get_block_ids_with_load_errors` and vLLM recomputes from there (the connector sets
`kv_load_failure_policy` to "recompute"); a store outage is a miss.

Saves: after each forward, the full chunks this step completed are handed to the store's loop,
which dedupes them against the index, copies them out of the engine's blocks straight into
canonical KV, and writes them: nothing of it runs on the step. Computed blocks never change, and
the blocks stay the request's while it runs; a finished request's blocks are held (delay-free)
until its copies are done, and a preempted request's copies still in flight are revoked (their
result is dropped, never stored: the blocks may be another request's by the next forward).

Request params are read once, when the request arrives (`params.py`): a malformed
`session_id`, `state` or hint is logged once for the request (values cut to 100 characters) and
dropped, and the request is served, looked up and stored as if that part were absent; it never costs
the request its hits, and never changes when its blocks are freed (`request_finished` holds them
whenever copies out of them may be in flight, whatever else fails).

Hybrid models (`groups.py`): the connector declares `SupportsHMA`, so vLLM keeps its hybrid allocator
on and gives each request block ids per KV cache group (full attention, sliding window, Mamba in align
mode). Chunks hold every attention layer's KV; a Mamba model's state is stored where a prefill step ends
on a chunk boundary (copied out on the step: vLLM frees that block two steps on) and loaded with the
chunks up to the last such boundary; a load that fails in part is a failed request, recomputed whole.
A Mamba model's session keeps the state after its last token (from the block holding it) and resumes
whole; a sliding-window model's turns are stored as prefixes only (a `session_id` is dropped, logged).

Sessions: a request whose `kv_transfer_params` holds `{"agentstate": {"session_id": ..., "state":
{...}}}` is snapshotted when it finishes (its blocks are held until then): tokens with computed KV
(prompt and generated, the last sampled token excepted: it has no KV yet), tail included, and the
state. A later request naming the same session whose prompt extends the session's tokens loads
all of it, tail included.

Agent hints: the same `agentstate` params carry what the agent framework knows about a session's
next seconds (see `agentstate.hints`)::

    kv_transfer_params={"agentstate": {"agent_id": "agent-7", "hint": "paused", "expected_s": 30}}

- `hint`: `"resuming"` (the tool returned: this request is the agent's next turn), `"paused"`
  (this turn ends with a tool call expected to take `expected_s` seconds, a number > 0, required)
  or `"done"` (the agent will not be back soon after this turn); or a list of `"resuming"` and one
  of the other two, for a returning turn that is expected to end in another tool call
  (`["resuming", "paused"]`) or to be the last (`["resuming", "done"]`). The framework sends what
  it expects when it sends the request: most agent turns end in a tool call.
- `agent_id`: the name the hold goes under, one per name and tenant (`[A-Za-z0-9_.:@-]`, 1-128
  chars): the agent session's id. A request that names a session (`session_id`) hints that session,
  tail included; `agent_id` may then be left out (if given, it must equal `session_id`).
- `resuming` applies when the request arrives (vLLM's `on_new_request`, before it is scheduled):
  the worker starts bringing the stored prefix of the prompt (`StateStore.hint_tokens`; a named
  session: `StateStore.hint`) up from LMDB/Redis into host memory on its loop, and the request's
  load waits for that (at most half of `timeout_s`) and reads host memory. When vLLM's own prefix
  cache holds the prompt's first chunks, only the stored chunks past them are brought up (no hold:
  the load follows at once), and nothing when it holds all that is stored (`hints_skipped`).
- `paused` and `done` apply when the request finishes, once what the connector stores for it is
  written: `paused` holds the prefix stored for the request (its tokens through the end of the
  request: prompt and generated) in the fast tiers for about `2 * expected_s` (eviction takes
  unheld LRU chunks first); `done` releases the hold.
- A hint never fails or changes its request: malformed hint params (unknown hint, `paused` without
  a positive `expected_s`, an invalid or missing name, `expected_s` as a string) are logged once per
  request (InvalidArgumentError) and counted (`hints_invalid`), and the request is served as if it
  carried none; a hint that fails in the store (no such session yet) is logged and counted
  (`hint_errors`). Hints never change what is stored, only where it waits.

Metrics (`vllm:agentstate_*`): besides the counts below, `bytes_read{tier=...}` (stored bytes loads
read, per tier), `hints`, `hint_moved_bytes` (resuming: bytes brought up into host memory),
`hint_errors`, `hints_invalid`, `hints_skipped`. Loads are also counted in the store's usage (`StateStore.usage()`:
loads, tokens_read, bytes_read per tier).

Never raises into vLLM's threads: every engine-facing call answers a miss (or a failed load) and
logs instead.

The package, by role (as vLLM's own OffloadingConnector): `connector.py` is the class vLLM loads, a
facade over `scheduler.py` (lookups, plans; no KV) or `worker.py` (the store, the lookup channel's
server, each step's copies: `loads.py`, `saves.py`, `hints.py`). Both roles share `config.py` (settings,
spec, chunk keys), `metadata.py` (what the scheduler tells the worker each step) and `metrics.py`.
`blocks.py` (block layouts), `lookup.py` and `params.py` need no vLLM import, nor does this module:
`AgentStateConnector` is imported from `connector.py` on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentstate.adapters.vllm.connector import AgentStateConnector

__all__ = ["AgentStateConnector"]


def __getattr__(name: str) -> Any:
    """`AgentStateConnector` is imported on first use: the package's vLLM-free modules (`blocks`,
    `lookup`, `params`, `config`) import without vLLM."""
    if name == "AgentStateConnector":
        from agentstate.adapters.vllm.connector import AgentStateConnector

        return AgentStateConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
