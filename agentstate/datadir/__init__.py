"""The data directory: one owner for its layout, its lock and what it records about itself.

A data directory is written by the library (`StateStore.open`), `agentstate serve`, the engine
adapters and the CLI's write commands, and read by every admin command. This package is the one
place that knows what lies in it:

- `LOCK`: the `flock(2)` lock a writer holds alone and readers share (`DataDirLock`);
- `spec.json`: the ModelSpec the directory's state belongs to. The first writer records it;
  every later opener, writer or reader, is checked against it, and a spec that differs is
  refused (`SpecMismatchError` naming the fields, never two fingerprints);
- `config.json`: the effective StoreConfig the last writer opened with (tiers spelled out, URL
  passwords replaced by `***`), so that a reader opens exactly the tiers the writer used;
- `catalog/`: the local catalog (LMDB); each tier's folder is the tier's own (`path` in its config).

Every file here is written atomically (a temp file, fsync'd, renamed, then the directory fsync'd),
so a crash leaves the old record or the new one, never a torn one. A directory written by an older
version (no `config.json`, or no `spec.json`) still opens: what is missing is recorded by the next
writer.
"""

from agentstate.datadir.files import (
    CATALOG,
    CONFIG,
    REDACTED,
    SPEC,
    adopt_spec,
    check_spec,
    directory_spec,
    is_store,
    read_spec_file,
    record,
    record_config,
    record_config_unheld,
    record_spec,
    recorded_config,
    recorded_spec,
    spec_differences,
    write_atomic,
)
from agentstate.datadir.lock import LOCK, DataDirLock

__all__ = [
    "CATALOG",
    "CONFIG",
    "LOCK",
    "REDACTED",
    "SPEC",
    "DataDirLock",
    "adopt_spec",
    "check_spec",
    "directory_spec",
    "is_store",
    "read_spec_file",
    "record",
    "record_config",
    "record_config_unheld",
    "record_spec",
    "recorded_config",
    "recorded_spec",
    "spec_differences",
    "write_atomic",
]
