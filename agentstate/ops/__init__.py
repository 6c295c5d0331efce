"""Operator tools behind the admin CLI: ls, inspect, stats, evict, gc (`admin`), verify and repair
(`verify`), export and import (`archive`). Each takes an open StateStore, uses its public API only,
and returns a pydantic report the CLI prints as a table or as JSON.
"""

from agentstate.ops.admin import QUIET, Progress, open_store, read_spec_file, record_spec, recorded_spec

__all__ = ["QUIET", "Progress", "open_store", "read_spec_file", "record_spec", "recorded_spec"]
