"""Log lines of bounded length: a client controls the ids and paths it sends, and a 100,000-character
session id in an access line (or in a warning about it) is a log-flooding lever, not information.

`ShortArgs` cuts every run of non-space characters longer than `MAX_TOKEN_CHARS` in a record's
arguments (and in a message logged without arguments) to its first `MAX_TOKEN_CHARS` characters,
noting how many were cut; sentences around it stay whole, so an error message keeps its meaning.
"""

from __future__ import annotations

import logging
import re
from typing import Any

MAX_TOKEN_CHARS = 100
_LONG = re.compile(r"\S{%d,}" % (MAX_TOKEN_CHARS + 1))


def cut(text: str) -> str:
    """`text` with each run of non-space characters past MAX_TOKEN_CHARS cut there."""
    if len(text) <= MAX_TOKEN_CHARS:
        return text
    return _LONG.sub(lambda m: f"{m.group()[:MAX_TOKEN_CHARS]}...(+{len(m.group()) - MAX_TOKEN_CHARS} chars)", text)


def _short(value: Any) -> Any:
    if isinstance(value, str):
        return cut(value)
    if isinstance(value, int | float) or value is None:
        return value  # kept as they are: %d and %g format them
    text = str(value)
    return cut(text) if len(text) > MAX_TOKEN_CHARS else value


class ShortArgs(logging.Filter):
    """Cut long tokens in a record before any handler formats it (see the module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(_short(a) for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: _short(v) for k, v in record.args.items()}
        elif not record.args and isinstance(record.msg, str):
            record.msg = cut(record.msg)
        return True


SERVICE_LOGGERS = ("uvicorn.access", "uvicorn.error", "agentstate.server.service", "agentstate.server.gate",
                   "agentstate.server.dataplane")  # fmt: skip
"""The loggers a serving process writes request-derived values to."""


def install(*names: str) -> None:
    """Put one ShortArgs on each named logger (idempotent)."""
    for name in names or SERVICE_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, ShortArgs) for f in logger.filters):
            logger.addFilter(ShortArgs())
