"""A real Mooncake Store on loopback for tests: a master and a storage process, stopped by PID.

The master (the `mooncake_master` binary shipped in the wheel) keeps object metadata and serves
the transfer engine's HTTP metadata, so no etcd is needed. Clients hold no memory of their own
(`segment_bytes=0`): a separate storage process contributes the global segment the values live
in, as a storage node would in production, so a test can kill it without killing the test.
Both ignore SIGTERM for seconds, so they are stopped with SIGKILL, by the PID Popen returned.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.ports import free_port
from tests.requires import skip_or_fail

STORAGE_SCRIPT = """
import sys, time
import mooncake.store as m
store = m.MooncakeDistributedStore()
rc = store.setup("127.0.0.1", sys.argv[1], int(sys.argv[2]), 16 << 20, "tcp", "", sys.argv[3])
print("ready" if rc == 0 else f"setup failed: {rc}", flush=True)
while rc == 0:
    time.sleep(3600)
"""


def die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the test process dies, even by a crash that skips
    fixture teardown (Linux prctl PR_SET_PDEATHSIG)."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)


def spawn(args: list[str], stdout: Any, stderr: Any) -> subprocess.Popen[bytes]:
    """A child with the quiet environment that dies with this process."""
    return subprocess.Popen(args, stdout=stdout, stderr=stderr, env=quiet_env(), preexec_fn=die_with_parent)  # noqa: PLW1509


def quiet_env() -> dict[str, str]:
    """Loopback transfers (the engine picks another interface otherwise) and glog errors only."""
    env = dict(os.environ)
    env.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    env.setdefault("GLOG_minloglevel", "2")
    env.setdefault("MC_LOG_LEVEL", "ERROR")
    return env


class MooncakeServer:
    def __init__(self, workdir: Path, segment_bytes: int = 256 << 20) -> None:
        os.environ.update({k: v for k, v in quiet_env().items() if k not in os.environ})  # read at import
        try:
            import mooncake.store
        except ImportError as exc:  # the CUDA wheel, or no wheel at all
            skip_or_fail(f"mooncake.store does not import ({exc}); pip install mooncake-transfer-engine-non-cuda")
        import mooncake

        self.binary = Path(os.path.dirname(mooncake.__file__)) / "mooncake_master"
        if not self.binary.exists():
            skip_or_fail(f"no mooncake_master binary at {self.binary}")
        self.workdir, self.segment_bytes = workdir, segment_bytes
        workdir.mkdir(parents=True, exist_ok=True)
        self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.master: subprocess.Popen[bytes] | None = None
        self.storage: subprocess.Popen[bytes] | None = None

    @property
    def master_addr(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    def backend(self, **kw: Any) -> Any:
        """A MooncakeBackend client of this store (a small arena unless told otherwise)."""
        from agentstate.backends.mooncake import MooncakeBackend

        kw.setdefault("buffer_bytes", 16 << 20)
        return MooncakeBackend(self.master_addr, metadata_url=self.metadata_url, admin_url=self.admin_url, **kw)

    def start(self) -> MooncakeServer:
        self.start_master()
        self.start_storage()
        return self

    def start_master(self) -> None:
        log = open(self.workdir / "master.log", "ab")  # noqa: SIM115 (the child owns it)
        self.master = spawn(
            [str(self.binary), "--rpc_address=127.0.0.1", f"--rpc_port={self.rpc_port}",
             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={self.http_port}", "--metrics_host=127.0.0.1",
             f"--metrics_port={self.metrics_port}"], log, subprocess.STDOUT,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.master.poll() is not None:
                skip_or_fail(f"mooncake_master exited with {self.master.returncode}: see {self.workdir}/master.log")
            try:
                urllib.request.urlopen(f"{self.admin_url}/metrics", timeout=0.5).read()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        skip_or_fail("mooncake_master did not answer on its metrics port within 10 s")

    def segments(self) -> list[str]:
        """Segments the master has mounted (its admin HTTP port)."""
        body = urllib.request.urlopen(f"{self.admin_url}/get_all_segments", timeout=1).read()
        return body.decode().split()

    def start_storage(self) -> None:
        """The process holding the global segment; ready once the master lists its segment (a
        moment after its setup() returned 0: puts before that fail with NO_AVAILABLE_HANDLE)."""
        log = self.workdir / "storage.log"
        before = len(self.segments())
        with open(log, "ab") as out:
            args = [sys.executable, "-c", STORAGE_SCRIPT, self.metadata_url, str(self.segment_bytes), self.master_addr]
            self.storage = spawn(args, out, subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            text = log.read_text(errors="replace")
            if "ready" in text and len(self.segments()) > before:
                return
            if self.storage.poll() is not None or "setup failed" in text:
                raise RuntimeError(f"mooncake storage process failed to start: {text[-500:]}")
            time.sleep(0.05)
        raise RuntimeError("mooncake storage process did not become ready within 20 s")

    def kill_storage(self) -> None:
        self._kill(self.storage)
        self.storage = None

    def kill_master(self) -> None:
        self._kill(self.master)
        self.master = None

    def stop(self) -> None:
        self.kill_storage()
        self.kill_master()

    @staticmethod
    def _kill(proc: subprocess.Popen[bytes] | None) -> None:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
