"""The demo's workload on a real (tiny, random-weight) transformers model: restored state changes
nothing the model says, returning agents prefill only their new tokens, and the plot is written."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from agentstate.demo import REPLY_TOKENS, run_demo


def test_demo_restores_state_without_changing_a_reply(tmp_path: Path) -> None:
    r = run_demo(tmp_path, agents=3, turns=3, system_tokens=300, user_tokens=40, layers=2, console=Console(quiet=True))
    assert r.replies_identical and len(r.stored) == 9
    first, *others = [t for t in r.stored if t.turn == 0]
    assert first.restored_tokens == 0  # nothing stored yet: it computes and stores the system prompt
    assert all(t.restored_tokens == 256 for t in others)  # the system prompt's whole chunks, shared
    for t in r.stored:
        if t.turn > 0:  # resumed: everything but the pending reply token and the new message
            assert t.restored_tokens == t.prompt_tokens - 1 - 40
    assert [t.prompt_tokens for t in r.stored] == [t.prompt_tokens for t in r.baseline]
    assert r.baseline[-1].prompt_tokens == 300 + 3 * 40 + 2 * REPLY_TOKENS
    assert r.png is not None and r.png.stat().st_size > 0
    assert 0 < r.stored_bytes < r.logical_bytes  # the system prompt is stored once for all agents
