"""A real SGLang server on CPU with HiCache on and agentstate as its L3, for tests (tests/test_sglang_server.py).

`SGLangServer` starts `tests/sglang_launch.py` (SGLang's launch_server plus the CPU stand-ins of
shared/notes/sglang-cpu.md) on a free loopback port, in a process group of its own, with its own TMPDIR,
and waits for /health (raising with the log's tail if it exits or times out). `stop()` SIGKILLs the
process group by its id, then removes what SGLang leaves behind: its TMPDIR (zmq socket files and other
temp files) and the /dev/shm files it created under random names (`sglang_loads_*.shm`, `sem.mp-*`).

`make_model` writes a tiny random-weight Qwen2 and a WordLevel tokenizer. `build_native_hash` builds
SGLang's C++ page-hash extension beforehand into the TORCH_EXTENSIONS_DIR every server is given: SGLang
would JIT-compile it inside its prefetch thread on the first L3 lookup (~40 s on 2 cores), and a
/flush_cache meanwhile kills the scheduler.

On 2 shared cores a server starts in 17-33 s (most of it SGLang's imports); a request takes 0.04-0.3 s.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from typing_extensions import Self

from tests.mooncake_server import die_with_parent
from tests.ports import address_in_use, free_port

ROOT = Path(__file__).resolve().parent.parent
LAUNCHER = ROOT / "tests" / "sglang_launch.py"
SHM = Path("/dev/shm")
SGLANG_SHM, MP_SHM = "sglang_loads_", "sem.mp-"  # what a killed server leaves in /dev/shm
AGENTSTATE_L3 = {"backend_name": "agentstate", "module_path": "agentstate.adapters.sglang",
                 "class_name": "AgentStateStorage"}  # fmt: skip


def make_model(path: str | Path, *, dtype: str = "float32", layers: int = 2, hidden: int = 128, heads: int = 2,
               kv_heads: int = 2, vocab: int = 512, seed: int = 0) -> str:  # fmt: skip
    """A tiny random-weight Qwen2 (safetensors, `dtype`) and a WordLevel tokenizer (`t0`..`t{vocab-1}`) in `path`."""
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    path = str(path)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=8192,
                         tie_word_embeddings=False, bos_token_id=2, eos_token_id=1)  # fmt: skip
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # sharper logits: greedy tokens depend on the context, not on noise
        for p in model.parameters():
            p.mul_(4.0)
    model = model.to(getattr(torch, dtype))
    model.config.dtype = getattr(torch, dtype)
    model.save_pretrained(path, safe_serialization=True)
    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1", bos_token="t2").save_pretrained(path)
    return path


def _env(tmpdir: Path, extensions_dir: Path) -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)  # the venv's ninja, for torch's JIT build
    return {**os.environ, "TMPDIR": str(tmpdir), "TORCH_EXTENSIONS_DIR": str(extensions_dir),
            "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]), "SGLANG_USE_CPU_ENGINE": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1"}  # fmt: skip


def build_native_hash(extensions_dir: str | Path, timeout: float = 600) -> Path:
    """Build SGLang's HiCache page-hash extension into `extensions_dir` (its TORCH_EXTENSIONS_DIR); a no-op
    when it is there already. Needs a C++ compiler, ninja and OpenSSL's headers (libssl-dev)."""
    ext = Path(extensions_dir)
    ext.mkdir(parents=True, exist_ok=True)
    (ext / "tmp").mkdir(exist_ok=True)
    code = "from sglang.srt.mem_cache.cpp_utils.native_hash import _load_native_hash_module as m; m()"
    proc = subprocess.run([sys.executable, "-c", code], env=_env(ext / "tmp", ext), capture_output=True, text=True,
                          timeout=timeout, check=False)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"building SGLang's native hash extension failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return ext


class SGLangServer:
    """One `sglang.launch_server` process (and its scheduler/detokenizer children) with HiCache on.

    `storage="agentstate"`: AgentStateStorage as L3 (`dynamic` backend) on `data_dir`, with `extra` added to
    its extra config; `storage="file"`: SGLang's own HiCacheFile on `data_dir` (a negative control);
    `storage=None`: no L3. `layout` is `layer_first` or `page_first_direct` (the layouts the `direct` io
    backend supports on CPU).
    """

    def __init__(self, model: str | Path, work_dir: str | Path, *, data_dir: str | Path | None = None,
                 extensions_dir: str | Path, page_size: int = 16, layout: str = "layer_first",
                 interface_v1: bool = True, prefetch_threshold: int = 16, extra: dict[str, Any] | None = None,
                 storage: str | None = "agentstate", dtype: str = "float32", startup_timeout: float = 300,
                 prefetch_policy: str | None = "wait_complete", args: list[str] | None = None,
                 tp: int = 1) -> None:  # fmt: skip
        if layout not in ("layer_first", "page_first_direct"):
            raise ValueError(f"layout {layout!r}: only layer_first and page_first_direct run on CPU")
        if storage not in ("agentstate", "file", None):
            raise ValueError(f"storage {storage!r}: agentstate, file or None")
        if storage is not None and data_dir is None:
            raise ValueError("an L3 needs data_dir")
        self.model, self.work = str(model), Path(work_dir)
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.extensions_dir = Path(extensions_dir)
        self.page_size, self.layout, self.interface_v1 = page_size, layout, interface_v1
        self.prefetch_threshold, self.extra, self.storage = prefetch_threshold, dict(extra or {}), storage
        self.dtype, self.startup_timeout, self.more_args = dtype, startup_timeout, list(args or [])
        self.prefetch_policy = prefetch_policy
        self.tp = tp
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.tmpdir = self.work / "tmp"
        self.log_path = self.work / "server.log"
        self.startup_s: float | None = None
        self._log: Any = None
        self._shm_before: set[str] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        # --enable-metrics: sglang:backuped_tokens_total counts the tokens written to L3 (wait_backed_up).
        # --mem-fraction-static 0.5: on CPU, SGLang refuses to start when free memory fell by more than
        # (1 - fraction) of what it was before the weights loaded. At 0.05 a neighbour allocating 5% of the
        # machine during that second (CI's vLLM suite runs beside this one) failed the start. The pool
        # is still --max-total-tokens, whatever the fraction allows.
        args = ["--model-path", self.model, "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu",
                "--dtype", self.dtype, "--attention-backend", "torch_native", "--disable-cuda-graph",
                "--grammar-backend", "none", "--skip-server-warmup", "--mem-fraction-static", "0.5",
                "--max-total-tokens", "4096", "--page-size", str(self.page_size), "--random-seed", "0",
                "--enable-hierarchical-cache", "--hicache-ratio", "2", "--hicache-io-backend", "direct",
                "--hicache-mem-layout", self.layout, "--log-level", "info",
                "--enable-metrics"]  # fmt: skip
        if self.tp > 1:
            args += ["--tp-size", str(self.tp)]
        if self.storage is not None:
            extra: dict[str, Any] = {"prefetch_threshold": self.prefetch_threshold}
            if self.storage == "agentstate":
                extra |= {**AGENTSTATE_L3, "interface_v1": int(self.interface_v1), "path": str(self.data_dir)}
            backend = "dynamic" if self.storage == "agentstate" else "file"
            config = json.dumps({**extra, **self.extra})
            args += ["--hicache-storage-backend", backend, "--hicache-storage-backend-extra-config", config]
            if self.prefetch_policy is not None:  # SGLang's default, `timeout`, cuts prefetches short on a busy machine
                args += ["--hicache-storage-prefetch-policy", self.prefetch_policy]
        return [sys.executable, str(LAUNCHER), *args, *self.more_args]

    def start(self, attempts: int = 3) -> Self:
        """Start the server; one that lost its port to another process before it bound it (it binds
        after ~30 s of imports) is started again on another port."""
        for attempt in range(attempts):
            try:
                return self._start_once()
            except RuntimeError:
                if attempt + 1 == attempts or not address_in_use(self.log_tail(chars=20000)):
                    raise
        raise AssertionError("unreachable")

    def _start_once(self) -> Self:
        self.work.mkdir(parents=True, exist_ok=True)
        self.tmpdir.mkdir(exist_ok=True)
        self.port = free_port()
        self._shm_before = set(os.listdir(SHM)) if SHM.is_dir() else set()
        env = _env(self.tmpdir, self.extensions_dir)
        if self.tp > 1:  # SGLang binds each rank to a NUMA node of its own unless told which CPUs: one node here
            cpus, per = sorted(os.sched_getaffinity(0)), max(1, len(os.sched_getaffinity(0)) // self.tp)
            groups = [cpus[min(r * per, len(cpus) - 1) :][:per] for r in range(self.tp)]
            env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)
        if self.storage == "file":
            env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = str(self.data_dir)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - the server writes to it until stop()
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.command(), cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=die_with_parent)  # noqa: PLW1509  # fmt: skip
        try:
            self._wait_healthy(t0 + self.startup_timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def _wait_healthy(self, deadline: float) -> None:
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"SGLang server exited (rc {self.proc.returncode}) during startup:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"SGLang server not healthy after {self.startup_timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    # -- requests ------------------------------------------------------------------------------

    def _post(self, path: str, body: dict[str, Any] | None, timeout: float) -> tuple[int, bytes]:
        data = json.dumps(body).encode() if body is not None else b""
        req = urllib.request.Request(self.url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def generate(self, input_ids: list[int], max_new_tokens: int = 8, return_logprob: bool = True,
                 timeout: float = 120, **sampling: Any) -> dict[str, Any]:  # fmt: skip
        """POST /generate, greedy: {"output_ids", "meta_info" (cached_tokens_details, output_token_logprobs...)}."""
        body = {"input_ids": list(input_ids), "return_logprob": return_logprob,
                "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True,
                                    **sampling}}  # fmt: skip
        status, raw = self._post("/generate", body, timeout)
        if status != 200:
            raise RuntimeError(f"/generate answered {status}: {raw[-2000:]!r}\n{self.log_tail(3000)}")
        return dict(json.loads(raw))

    def flush_cache(self, timeout: float = 60) -> None:
        """POST /flush_cache (device and host pool; L3 is kept), retried while requests still run."""
        deadline = time.monotonic() + timeout
        while True:
            status, raw = self._post("/flush_cache", None, 30)
            if status == 200:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"/flush_cache answered {status}: {raw[-1000:]!r}\n{self.log_tail(3000)}")
            time.sleep(0.2)

    def metrics(self) -> dict[str, float]:
        """GET /metrics: each `sglang:` sample's value, summed over its labels (name without the prefix)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("sglang:"):
                name, _, value = line.rpartition(" ")
                key = name.split("{")[0][len("sglang:") :]
                out[key] = out.get(key, 0.0) + float(value)
        return out

    def wait_backed_up(self, tokens: int, timeout: float = 60) -> float:
        """Wait until SGLang counts at least `tokens` tokens written to L3 in all (its storage writes are
        acknowledged after the request returns; a /flush_cache before that drops them). Returns the count."""
        deadline = time.monotonic() + timeout
        while True:
            done = self.metrics().get("backuped_tokens_total", 0.0)
            if done >= tokens:
                return done
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{done:.0f} of {tokens} tokens written to L3 after {timeout:.0f} s\n{self.log_tail(3000)}"
                )
            time.sleep(0.1)

    # -- teardown ------------------------------------------------------------------------------

    def stop(self, timeout: float = 30) -> None:
        """SIGKILL the server's whole process group, wait until it is gone, then remove what it left
        behind. Idempotent.

        No SIGTERM first: SGLang answers it by draining and sleeping (~6 s a server, twelve servers a
        run), and it SIGKILLs its scheduler anyway, so the L3 backend is never closed either way; what
        agentstate committed is on disk already (write-through), which is what the next server checks.
        """
        proc, self.proc = self.proc, None
        ours: set[str] = set()
        if proc is not None:
            ours = _open_files(_group_members(proc.pid))  # what its processes hold, read before they die
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout)
            end = time.monotonic() + timeout
            while _group_alive(proc.pid) and time.monotonic() < end:
                time.sleep(0.05)
        if self._log is not None:
            self._log.close()
            self._log = None
        self._cleanup(ours)

    def _cleanup(self, ours: set[str]) -> None:
        """Its zmq socket files and temp files (its TMPDIR), and what a killed server leaves in /dev/shm
        under random names: SGLang's `sglang_loads_*.shm` that appeared since start(), and the
        multiprocessing semaphores (`sem.mp-*`) its own processes had mapped. Either only when no live
        process has it open or mapped: other suites (a vLLM engine beside this one in CI) make `sem.mp-*`
        files too, and removing one of theirs breaks their shutdown."""
        if SHM.is_dir():
            new = set(os.listdir(SHM)) - self._shm_before
            doomed = [SHM / n for n in new if n.startswith(SGLANG_SHM) or (n.startswith(MP_SHM) and str(SHM / n) in ours)]
            held = _open_files() if doomed else set()
            for path in doomed:
                if str(path) not in held:
                    path.unlink(missing_ok=True)
        if self.tmpdir.is_dir():
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir.mkdir(exist_ok=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _group_members(pgid: int) -> list[str]:
    """The pids (as /proc names) of the live processes in process group `pgid`."""
    members = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[2] == str(pgid):
            members.append(pid)
    return members


def _open_files(pids: list[str] | None = None) -> set[str]:
    """Paths the processes `pids` (default: every live one) have open or mapped (what /proc lets this
    user see)."""
    held: set[str] = set()
    for pid in pids if pids is not None else filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                held.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                pass
        try:  # mapped files outlive their descriptors
            with open(f"/proc/{pid}/maps") as maps:
                held.update(line.split(maxsplit=5)[5].strip() for line in maps if "/dev/shm/" in line)
        except (OSError, IndexError):
            pass
    return held


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
