"""Run the `agentstate` CLI in a process of its own, without paying torch's import each time.

Every `agentstate` command that opens a store imports torch (~3 s of CPU here), and the CLI tests run a
few hundred commands: most of a CI run's CPU went to importing torch again and again. `run_cli` sends
each command to a zygote process (one per test process) that imported the CLI and the store once; the
zygote forks, and the child runs `agentstate.cli.main` exactly as the installed entry point does
(`sys.exit(main())`): its own process, working directory, environment, stdin from /dev/null, stdout and
stderr to files, the interpreter's normal exit (threads joined, atexit handlers, streams flushed), a
SIGALRM at the timeout. Nothing is shared with the test process but the code already imported.

Tests of the entry point itself (the console script, `--help` without torch, a module blocked from
importing) still start a fresh interpreter; tests/test_cli.py checks that both agree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

ZYGOTE = r"""
import importlib, io, json, os, signal, sys
import torch  # noqa: F401  what every store command imports, once
import agentstate.cli, agentstate.store, agentstate.ops.admin, agentstate.ops.verify, agentstate.ops.archive  # noqa: F401
replies = sys.stdout.buffer
for line in sys.stdin.buffer:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:  # the command: from here on, a process like `agentstate ARGS`
        signal.alarm(req["timeout"])
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 1)
        os.dup2(os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 2)
        sys.stdin = io.TextIOWrapper(open(0, "rb", closefd=False))
        sys.argv = ["agentstate", *req["args"]]
        importlib.reload(agentstate.cli)  # its module state (rich consoles sized from COLUMNS) made as at a start
        sys.exit(agentstate.cli.main())  # SystemExit or an exception ends this child as it ends a process
    _, status = os.waitpid(pid, 0)
    replies.write((json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n").encode())
    replies.flush()
"""


class _Zygote:
    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def _started(self) -> subprocess.Popen[bytes]:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT
            )
        return self._proc

    def run(self, args: list[str], env: dict[str, str], cwd: str, timeout: int) -> tuple[int, str, str]:
        with self._lock, tempfile.TemporaryDirectory(prefix="agentstate-cli-") as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            proc = self._started()
            assert proc.stdin is not None and proc.stdout is not None
            req = {"args": args, "env": env, "cwd": cwd, "timeout": timeout, "stdout": out, "stderr": err}
            proc.stdin.write((json.dumps(req) + "\n").encode())
            proc.stdin.flush()
            reply = proc.stdout.readline()
            if not reply:
                raise RuntimeError(f"the CLI zygote exited ({proc.poll()}) running agentstate {' '.join(args)}")
            code = json.loads(reply)["code"]
            return code, Path(out).read_text(errors="replace"), Path(err).read_text(errors="replace")

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


_zygote = _Zygote()


def run_cli(
    *args: str | Path, env: dict[str, str] | None = None, cwd: str | Path | None = None, timeout: int = 300
) -> subprocess.CompletedProcess[str]:
    """`agentstate ARGS` with `env` as its whole environment (default: this process's), like
    `subprocess.run([...], capture_output=True, text=True)`; TimeoutExpired past `timeout` seconds."""
    argv = [str(a) for a in args]
    code, stdout, stderr = _zygote.run(argv, dict(os.environ if env is None else env), str(cwd or os.getcwd()), timeout)
    if code == -14:  # SIGALRM: the command ran past its time
        raise subprocess.TimeoutExpired(["agentstate", *argv], timeout, stdout, stderr)
    return subprocess.CompletedProcess(["agentstate", *argv], code, stdout, stderr)


def close() -> None:
    _zygote.close()
