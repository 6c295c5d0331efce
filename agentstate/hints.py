"""Agent hints: what an agent framework tells the store about a session's next few seconds.

An agent framework knows what no cache policy can guess: the session just paused for a tool call
expected to take about `expected_s` seconds (`paused`), its next turn is about to be sent
(`resuming`), or it is finished (`done`). The store turns these into holds on the fast tiers
(`agentstate.chunks.holds`) and, for `resuming`, a prefetch from the slow tiers into host memory,
so the returning request reads memory only.

How long `paused` holds: until the expected return, twice over (tools overrun; a hold that ends
just before the session returns is the worst case), plus the time a reload of the session from
the slow tiers would take (past that, reloading would have to start anyway), capped by
`hint_max_hold_s`. Holds are bounded per tenant (`hint_tenant_share` of a tier) and never lose
data: eviction of a held chunk writes it down first.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from agentstate.errors import InvalidArgumentError

HintKind = Literal["paused", "resuming", "done"]
MAX_EXPECTED_S = 7 * 24 * 3600.0


class Hint(BaseModel):
    """One hint about a session (the service's `POST /v1/sessions/{id}/hints` body)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)  # "30" is not a number of seconds

    hint: HintKind
    expected_s: float | None = Field(
        default=None, gt=0, le=MAX_EXPECTED_S, allow_inf_nan=False,
        description="paused: seconds until the session is expected back (the tool call's expected duration)",
    )  # fmt: skip

    @model_validator(mode="after")
    def _expected_for_paused(self) -> Hint:
        if self.hint == "paused" and self.expected_s is None:
            raise ValueError("a paused hint needs expected_s, the seconds until the session is expected back")
        return self

    @classmethod
    def parse(cls, hint: object, expected_s: object = None) -> Hint:
        """A Hint from loose arguments, or InvalidArgumentError."""
        if isinstance(hint, Hint):
            return hint
        try:
            return cls.model_validate({"hint": hint, "expected_s": expected_s})
        except ValidationError as exc:
            detail = "; ".join(e["msg"] for e in exc.errors())
            raise InvalidArgumentError(f"invalid hint: {detail}") from None


class HintResult(BaseModel):
    """What a hint did."""

    model_config = ConfigDict(frozen=True)

    session_id: str
    hint: HintKind
    held_until: float | None = Field(description="wall clock: when the hold on the fast tiers ends (None: released)")
    expected_back_at: float | None = Field(description="wall clock: when the session is expected back")
    chunks: int = Field(description="chunks of the session, tail included")
    in_memory: int = Field(description="of them, how many the host memory tier holds now")
    moved_chunks: int = Field(default=0, description="resuming: chunks brought up from slower tiers")
    moved_bytes: int = Field(default=0, description="resuming: stored bytes brought up")
    tenant_held_bytes: int = Field(default=0, description="host memory tier: bytes this tenant's holds claim there")
    tenant_share_bytes: int | None = Field(default=None, description="host memory tier: the most they may claim")


def paused_hold_s(expected_s: float, session_bytes: int, *, reload_bytes_per_s: int, max_hold_s: float) -> float:
    """How long a paused session is held (see the module docstring)."""
    return min(max_hold_s, 2.0 * expected_s + session_bytes / reload_bytes_per_s)
