"""A vLLM request's `kv_transfer_params["agentstate"]`, read once when the request arrives.

Everything here comes from outside (an API client writes it), so it is checked before any of it is
used, and a bad part costs the request nothing but that part: a malformed `session_id`, `state` or
hint is dropped (the request is served, looked up and stored as if the part were absent) and named
in `problems`, which the connector logs once per request. Checking late, at the request's end, is
what let a bad session id escape from `request_finished` and free blocks that were still being
copied out (issue 25), so nothing in this module raises.

Values from a request are cut with `clip` before they go into any message: an id can be 100,000
characters long, and a log line must not be.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from agentstate.errors import AgentStateError, InvalidArgumentError
from agentstate.hints import Hint, HintKind
from agentstate.keys import validate_id

CLIP_CHARS = 100  # of one value from a request, in a log line or an error message
HINT_KEYS = ("hint", "expected_s", "agent_id")


def clip(value: object, limit: int = CLIP_CHARS) -> str:
    """`value` as text (repr for non-strings), at most about `limit` characters: what a log line shows
    of something a client sent."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...({len(text)} chars)"


def clip_message(exc: BaseException, limit: int = 3 * CLIP_CHARS) -> str:
    """`Type: message` of an error, cut: its message may quote a request's values."""
    return f"{type(exc).__name__}: {clip(str(exc), limit)}"


@dataclass(frozen=True)
class RequestHint:
    """The agent hints of one request's kv_transfer_params: one when it arrives, one when it finishes."""

    arrival: HintKind | None  # resuming
    finish: HintKind | None  # paused or done
    expected_s: float | None
    name: str
    session: bool  # the name is the request's session_id: the named session is hinted (tail included)


@dataclass(frozen=True)
class RequestParams:
    """What the connector uses of one request's params; `problems` are the parts it dropped, each
    `(part, message)` with every value already cut."""

    session_id: str | None = None
    state: dict[str, Any] | None = None
    hint: RequestHint | None = None
    problems: tuple[tuple[str, str], ...] = ()

    @property
    def session(self) -> tuple[str, dict[str, Any]] | None:
        """(session id, state) when the request names a valid session."""
        return None if self.session_id is None else (self.session_id, self.state or {})


NO_PARAMS = RequestParams()


def _own(params: Any) -> dict[str, Any] | None:
    if not isinstance(params, dict) or not isinstance(params.get("agentstate"), dict):
        return None
    return params["agentstate"]


def _session_id(own: dict[str, Any]) -> str:
    sid = own["session_id"]
    if not isinstance(sid, str):
        raise InvalidArgumentError(f"session_id must be a string, not {type(sid).__name__} {clip(sid)}")
    try:
        return validate_id(sid)
    except AgentStateError:
        raise InvalidArgumentError(
            f"invalid session_id {clip(sid)}: 1-128 chars of [A-Za-z0-9_.:@-], starting with a letter, digit or _"
        ) from None


def _state(own: dict[str, Any]) -> dict[str, Any]:
    """The session's state: a JSON object (what the session manifest keeps), absent or null for {}."""
    state = own.get("state")
    if state is None:
        return {}
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise InvalidArgumentError(f"state must be a JSON object, not {type(state).__name__} {clip(state)}")
    try:
        json.dumps(state, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"state is not JSON ({clip(str(exc))}): {clip(state)}") from None
    return state


def hint_of(own: dict[str, Any], session_id: str | None) -> RequestHint | None:
    """The agent hint in a request's params (`{"hint": ..., "expected_s": ..., "agent_id": ...}`),
    None when it carries none; InvalidArgumentError when it is malformed. `session_id`: the request's
    valid session id, if any (a hint then names that session)."""
    if not any(k in own for k in HINT_KEYS):
        return None
    if "hint" not in own:
        raise InvalidArgumentError(f"agentstate params {sorted(k for k in HINT_KEYS if k in own)} without a hint")
    kinds = own["hint"] if isinstance(own["hint"], list) else [own["hint"]]
    parsed = []
    for kind in kinds:
        try:
            parsed.append(Hint.parse(kind, own.get("expected_s")))
        except AgentStateError as exc:  # its message names no value: say which one
            raise InvalidArgumentError(
                f"hint {clip(kind)}, expected_s {clip(own.get('expected_s'))}: {clip(str(exc), 200)}"
            ) from None
    arrival = [h.hint for h in parsed if h.hint == "resuming"]
    finish = [h.hint for h in parsed if h.hint != "resuming"]
    if not parsed or len(arrival) > 1 or len(finish) > 1:
        raise InvalidArgumentError(
            f"hint {clip(own['hint'])}: one hint, or a list of resuming and one of paused/done (what the request"
            " returns from, what its end starts)"
        )
    agent = own.get("agent_id")
    if session_id is None and agent is None:
        raise InvalidArgumentError("a hint needs agent_id (or the request's session_id) to name its hold")
    if session_id is not None and agent is not None and agent != session_id:
        raise InvalidArgumentError(f"hint agent_id {clip(agent)} is not the request's session_id {clip(session_id)}")
    if session_id is None:
        try:
            validate_id(agent, "agent_id")
        except AgentStateError:
            raise InvalidArgumentError(f"invalid agent_id {clip(agent)}: 1-128 chars of [A-Za-z0-9_.:@-]") from None
    expected = next((h.expected_s for h in parsed if h.hint == "paused"), None)
    name = session_id if session_id is not None else agent
    return RequestHint(arrival[0] if arrival else None, finish[0] if finish else None, expected, name,
                       session_id is not None)  # fmt: skip


def parse_params(params: Any) -> RequestParams:
    """A request's agentstate params, checked; never raises. A bad session_id drops the session and
    its hint (the hint would name the bad id); a bad state drops the state only; a bad hint drops
    the hint only."""
    own = _own(params)
    if own is None:
        return NO_PARAMS
    problems: list[tuple[str, str]] = []
    session_id: str | None = None
    state: dict[str, Any] | None = None
    hint: RequestHint | None = None
    sid_ok = True
    if own.get("session_id") is not None:
        try:
            session_id = _session_id(own)
        except Exception as exc:  # noqa: BLE001 - anything a client sends is a problem, never a failure
            problems.append(("session_id", clip_message(exc)))
            sid_ok = False
    if session_id is not None:
        try:
            state = _state(own)
        except Exception as exc:  # noqa: BLE001
            problems.append(("state", clip_message(exc)))
            state = {}
    if sid_ok:
        try:
            hint = hint_of(own, session_id)
        except Exception as exc:  # noqa: BLE001
            problems.append(("hint", clip_message(exc)))
    elif any(k in own for k in HINT_KEYS):
        problems.append(("hint", "InvalidArgumentError: it names the request's invalid session_id"))
    return RequestParams(session_id, state, hint, tuple(problems))
