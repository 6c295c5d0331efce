"""Import onto a disk that fills is all-or-nothing (issue 25, item 6), whenever the disk fills.

The target store lives on a 12 MiB tmpfs and holds three sessions (one of them at version 2);
the archive holds 24 new sessions and a replacement of one of the target's (~28 MiB of KV). The
import is refused with a CapacityError, and afterwards the target holds exactly what it held
before: the same manifests (versions included), KV that resumes bit-exact, the same keys in
every tier (the host tier included, seen by the same process), no catalog entry of the import.
The disk fills at each point that matters:

- `chunks`: the staged chunks themselves run out of room, part way through;
- `nearly-full`: a ballast leaves less than the undo's room, so the first step is refused;
- `undo`: after the staging write fails, the rest of the disk is filled to the last byte, so the
  undo has only the room the import held back for it;
- `commit`: an archive that fits; once the last session's chunks are written, the disk is filled
  to the last byte before the catalog's next write transaction: the commit of every session,
  which fails for lack of pages; then the undo runs.

Each runs with the chunks in LMDB's own pages and in its value log.

Before the fix, the sessions stored before the disk filled stayed: the undo (deletes and
manifest writes in LMDB) needed room that was gone. Also here: the CLI's exit code and its one
error line, and a SIGKILL at several points of a CLI import leaves no session of it and, after
gc, no chunk of it. Needs root to mount a tmpfs (skipped elsewhere, failed in CI).
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agentstate import StateStore, StoreConfig
from agentstate.catalog.lmdb import LMDBCatalog
from agentstate.chunks.store import ChunkStore
from agentstate.errors import CapacityError
from agentstate.ops.archive import import_sessions
from tests.cli_process import run_cli
from tests.conftest import SPEC4, bits_equal
from tests.requires import skip_or_fail
from tests.test_import_atomic import CHUNK, config, observe, target_sessions, write_archive, write_target

DISK = "12m"
SESSIONS, TOKENS = 24, 600  # 24 sessions of 600 tokens of their own (1.2 MiB of KV each), and a replacement of s0
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("archive") / "big.tar"
    asyncio.run(write_archive(path, sessions=SESSIONS, tokens=TOKENS))
    assert path.stat().st_size > 28 << 20  # more than twice the disk
    return path


FITS_SESSIONS = 6
"""sessions in `fits`, each writing its chunks and tail in one ChunkStore.write"""


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 sessions and the replacement of s0 (~6 MiB): fits the disk beside the target."""
    path = tmp_path_factory.mktemp("fits") / "fits.tar"
    asyncio.run(write_archive(path, sessions=4, tokens=TOKENS))
    return path


def _mount(mount: Path) -> None:
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs", str(mount)], capture_output=True, check=False
    )
    if done.returncode != 0:
        skip_or_fail(f"cannot mount a tmpfs to fill (needs root): {done.stderr.decode().strip()}")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "disk"
    _mount(mount)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(disk: Path, name: str = "ballast", leave: int = 0) -> Path:
    """Fill the disk to the last byte (a file written until ENOSPC), then give back `leave` bytes."""
    path = disk / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for piece in (1 << 20, 4096):
            try:
                while True:
                    os.write(fd, b"\1" * piece)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)
    if leave:
        os.truncate(path, max(0, path.stat().st_size - leave))
    return path


async def keys_everywhere(store: StateStore) -> dict[tuple[str, str], list[str]]:
    """Every key every tier holds (the host tier included: only this process sees it)."""
    return {
        (tier, prefix): sorted(await store.chunks.scan(tier, prefix))
        for tier in store.chunks.tier_names
        for prefix in store.key_prefixes
    }


@pytest.fixture
async def target(small_disk: Path) -> AsyncIterator[tuple[Path, dict[str, Any]]]:
    data = small_disk / "target"
    await write_target(data)
    yield data, await observe(data)


def _hook(monkeypatch: pytest.MonkeyPatch, cls: type, name: str, before: Callable[[], object] | None = None,
          on_error: Callable[[], None] | None = None) -> list[int]:  # fmt: skip
    """Wrap `cls.name`: `before` runs before each call, `on_error` when a call raises. The
    component still does all the work: the hooks only fill the disk at that moment."""
    real = getattr(cls, name)
    calls: list[int] = []

    async def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if before is not None:
            before()
        try:
            return await real(self, *args, **kwargs)
        except BaseException:
            if on_error is not None:
                on_error()
            raise

    monkeypatch.setattr(cls, name, wrapped)
    return calls


def import_config(data: Path, value_log: bool) -> StoreConfig:
    """The target's config; with `value_log`, chunks (128 KiB) go to LMDB's value log (as real
    models' MiB chunks do by default) instead of LMDB's own pages."""
    return config(data).model_copy(update={"lmdb_value_log_min_bytes": 64 << 10}) if value_log else config(data)


@pytest.mark.parametrize("value_log", [False, True], ids=["lmdb", "value-log"])
@pytest.mark.parametrize("fill_point", ["chunks", "nearly-full", "undo", "commit"])
async def test_import_refused_by_a_full_disk_leaves_the_store_as_it_was(
    target: tuple[Path, dict[str, Any]], archive: Path, fits: Path, small_disk: Path,
    monkeypatch: pytest.MonkeyPatch, fill_point: str, value_log: bool,
) -> None:  # fmt: skip
    data, before = target
    if fill_point == "nearly-full":
        fill(small_disk, leave=512 << 10)
    filled: list[Path] = []

    def fill_once() -> None:  # the hooks only fill the disk: every write is the component's own
        if not filled:
            filled.append(fill(small_disk))

    async with StateStore.open(import_config(data, value_log), SPEC4) as store:
        keys_before, chunks_before = await keys_everywhere(store), len(store.chunks)
        if fill_point == "commit":  # at the catalog's first write (its one write path) after the last chunks
            staged = _hook(monkeypatch, ChunkStore, "write")
            _hook(monkeypatch, LMDBCatalog, "_write", before=lambda: len(staged) == FITS_SESSIONS and fill_once())
        if fill_point == "undo":
            _hook(monkeypatch, ChunkStore, "write", on_error=lambda: fill(small_disk, "ballast-at-undo"))
        with pytest.raises(CapacityError):  # the commit case: 4 sessions (~6 MiB) fit, until the disk is filled
            await import_sessions(store, fits if fill_point == "commit" else archive, force=True)
        monkeypatch.undo()
        assert await keys_everywhere(store) == keys_before, fill_point  # no chunk of it in any tier
        stored = {(tier, key) for (tier, _), keys in keys_before.items() for key in keys}
        known = {(tier, key) for key in store.chunks._index._nodes for tier in store.chunks.where(key)}
        assert known <= stored and chunks_before <= len(store.chunks)  # the index names nothing the tiers lack
        assert bool(filled) == (fill_point == "commit")  # the disk filled before the commit, or at it
        assert {(m.tenant, m.session_id) for m in await store.catalog.manifests(None)} == set(before["manifests"])
    for ballast in small_disk.glob("ballast*"):
        ballast.unlink()

    after = await observe(data)
    assert after["manifests"] == before["manifests"], fill_point
    assert after["keys"] == before["keys"], fill_point
    for name, kv in before["kv"].items():
        assert bits_equal(after["kv"][name], kv), (fill_point, name)
    async with StateStore.open(config(data), SPEC4) as store:  # and it takes writes again
        tokens, kv, _ = target_sessions()[("default", "s1")]
        await store.snapshot("after", tokens, kv)
        resumed = (await store.resume("after")).kv
        assert resumed is not None and bits_equal(resumed, kv)


def cli_env() -> dict[str, str]:
    return {
        **os.environ, "AGENTSTATE_CHUNK_TOKENS": str(CHUNK), "AGENTSTATE_LMDB_MAP_SIZE": str(64 << 20),
        "COLUMNS": "4000",  # one line is one line, however long (no wrapping at a terminal's width)
    }  # fmt: skip


@pytest.mark.parametrize("ballast_mib", [0, 2, 6, 9])
async def test_cli_import_onto_a_small_disk_exits_1_with_one_line(
    target: tuple[Path, dict[str, Any]], archive: Path, small_disk: Path, ballast_mib: int
) -> None:
    """The issue's run: 24 sessions (28 MiB) into a store on a 12 MiB filesystem, with a ballast of
    0, 2, 6 or 9 MiB already there, so the disk fills at another session each time."""
    data, before = target
    if ballast_mib:
        (small_disk / "ballast").write_bytes(b"\1" * (ballast_mib << 20))
    done = run_cli("import", archive, "-p", data, "--force", env=cli_env())
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("error (CapacityError): "), done.stderr
    assert "Traceback" not in done.stderr
    (small_disk / "ballast").unlink(missing_ok=True)
    after = await observe(data)
    assert after["manifests"] == before["manifests"] and after["keys"] == before["keys"]
    for name, kv in before["kv"].items():
        assert bits_equal(after["kv"][name], kv), name


KILL_AT = [1 << 20, 5 << 19, 4 << 20]
"""bytes the import has taken on the disk (staged chunks and the room held for the undo) when it
is killed: all well before its commit, which comes after ~8 MiB"""
IMPORTED = {("default", s) for s in ("s0", "z", "n0", "n1", "n2", "n3")}


async def test_sigkill_mid_import_leaves_no_session_of_it(small_disk: Path, fits: Path) -> None:
    """A CLI import killed at several points, each into a fresh copy of the target: no session of
    it is visible, nothing else changed, and gc takes every chunk it staged. (A kill that came
    after the commit, on a machine slow to poll, must find every session of it, whole.)"""
    data = small_disk / "target"
    for kill_at in KILL_AT:
        shutil.rmtree(data, ignore_errors=True)
        await write_target(data)
        before = await observe(data)
        free = free_bytes(small_disk)
        proc = subprocess.Popen([sys.executable, "-m", "agentstate", "import", str(fits), "-p", str(data), "--force"],
                                cwd=ROOT, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
        while proc.poll() is None and free - free_bytes(small_disk) < kill_at:
            time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
        stderr = proc.communicate()[1].decode()
        assert proc.returncode in (-signal.SIGKILL, 0), stderr[-2000:]

        async with StateStore.open(config(data), SPEC4) as store:
            names = {(m.tenant, m.session_id) for m in await store.catalog.manifests(None)}
            await store.gc()
        after = await observe(data)
        if names == set(before["manifests"]):  # killed before the commit: nothing of it
            assert after["manifests"] == before["manifests"] and after["keys"] == before["keys"], kill_at
            for name, kv in before["kv"].items():
                assert bits_equal(after["kv"][name], kv), (kill_at, name)
        else:  # killed after: all of it (every session resumes, observe checked)
            assert names == set(before["manifests"]) | IMPORTED, (kill_at, sorted(names))

    done = run_cli("import", fits, "-p", data, "--force", env=cli_env())  # and the same import then goes in whole
    assert done.returncode == 0, done.stderr
    async with StateStore.open(config(data), SPEC4) as store:
        names = {(m.tenant, m.session_id) for m in await store.catalog.manifests(None)}
    assert names == set(before["manifests"]) | IMPORTED
