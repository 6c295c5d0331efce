#!/usr/bin/env python
"""Peer benchmark: SGLang HiCache's own file L3 backend (`HiCacheFile`) on this machine's CPU.

    python benchmarks/peer_hicache.py                    # 2/8/32 MiB pages, ~1 GiB each, concurrency 1 and 8
    python benchmarks/peer_hicache.py --quick            # 64 MiB per case (smoke check)
    python benchmarks/peer_hicache.py --root /tmp/x --sizes-mib 8 --concurrency 1 4 --total-mib 512

Needs sglang importable without letting pip touch torch (checked with sglang 0.5.23):

    pip install --no-deps sglang psutil pybase64 triton pillow starlette anyio msgspec pyzmq tqdm \
        aiohttp multidict yarl propcache aiohappyeyeballs aiosignal frozenlist

Nothing is pip-installed here; if sglang is missing the script says so and exits 2.

What `HiCacheFile` does (sglang 0.5.23, `sglang/srt/mem_cache/hicache_storage.py`):

* one file per page: `<root>/<key>_<model>_<tp_rank>_<tp_size>.bin`, holding the page tensor's raw
  bytes (`tensor.contiguous().view(uint8).numpy().tofile(tmp)` then `os.replace(tmp, final)`);
  no header, no checksum, no pickle / `torch.save`, and **no fsync** (the rename is atomic but not
  durable). `set` first checks `exists` and skips a key already on disk.
* `get(key, target_location)` opens the file unbuffered and `readinto`s the caller's tensor memory
  (zero-copy into `target_location`); a short read raises, a missing file returns None.
* `batch_get` / `batch_set` are plain sequential loops over `get` / `set`. No threads inside:
  SGLang's cache controller calls them from one prefetch-IO thread and one backup thread per rank,
  in batches of at most `STORAGE_BATCH_SIZE` (128) pages. `concurrency` > 1 here stands in for
  several ranks / a thread pool calling the backend at once.

What this measures, per (page size, concurrency):

* write: `batch_set` of all pages from `concurrency` threads (page-cache speed: HiCacheFile does not
  fsync), then, timed apart, an fsync of every file it wrote (`write_sync_gbps` = bytes / (write +
  fsync time), the figure comparable to a durable store). The fsync is ours, not HiCacheFile's.
* warm read: `batch_get` into preallocated, already-touched page tensors (rows of one host buffer)
  from `concurrency` threads; median of `warm_repeats` passes.
* warm read, controller path: what `HiCacheController._generic_page_get` really does: a fresh
  `torch.zeros` dummy page per key, `batch_get` into it, then `copy_` into the host pool slot.
* cold read: as warm, after `echo 3 > /proc/sys/vm/drop_caches` (falls back to
  `posix_fadvise(DONTNEED)` per file when drop_caches is not permitted; skipped if neither works).

Every read pass is checked byte-exact against the written pages (the buffer is zeroed untimed
before each pass). GB = 1e9 bytes; bytes are page payload bytes. Data lives in a fresh directory
under `root` and is removed afterwards.

Page sizes: a Llama-3-8B KV page (32 layers x K,V x 8 heads x 128 dim x bf16 = 128 KiB per token)
is 2 MiB at 16 tokens per page, 8 MiB at 64, 32 MiB at 256.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import torch

MiB = 1 << 20
GiB = 1 << 30
GB = 1e9
MODEL_NAME = "bench/llama-3-8b-shape"


def _import_sglang():
    try:
        import sglang
        from sglang.srt.mem_cache.hicache_storage import (
            STORAGE_BATCH_SIZE,
            HiCacheFile,
            HiCacheStorageConfig,
        )
    except Exception as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"sglang's HiCacheFile is not importable ({type(e).__name__}: {e}); install with "
            "`pip install --no-deps sglang` and the missing pure-Python deps, each with --no-deps"
        ) from e
    try:
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    except Exception:  # older/newer layouts: construct the class directly, as the factory does
        StorageBackendFactory = None
    return sglang.__version__, HiCacheFile, HiCacheStorageConfig, StorageBackendFactory, STORAGE_BATCH_SIZE


def make_backend(file_path: str):
    """Build HiCacheFile the way SGLang does: HiCacheStorageConfig (as
    HiCacheController._generate_storage_config fills it for TP=1, PP=1, non-MLA, page_first
    host layout) + StorageBackendFactory.create_backend("file", config, mem_pool_host)."""
    _, HiCacheFile, HiCacheStorageConfig, Factory, _ = _import_sglang()
    config = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name=MODEL_NAME,
        extra_config={"file_storage_path": file_path},  # --hicache-storage-backend-extra-config
    )
    if Factory is not None:
        backend = Factory.create_backend("file", config, None)  # "file" ignores mem_pool_host
    else:
        backend = HiCacheFile(config)
    return backend


# -- helpers ------------------------------------------------------------------------------------


def _keys(n: int, salt: str) -> list[str]:
    # SGLang keys are sha256 hex digests of the page's token ids chained with the prefix's.
    return [hashlib.sha256(f"{salt}:{i}".encode()).hexdigest() for i in range(n)]


def _split(n: int, parts: int) -> list[range]:
    parts = max(1, min(parts, n))
    step, extra = divmod(n, parts)
    out, start = [], 0
    for p in range(parts):
        end = start + step + (1 if p < extra else 0)
        out.append(range(start, end))
        start = end
    return out


def _run_threads(n: int, concurrency: int, work: Callable[[range], Any]) -> tuple[float, list[Any]]:
    """Run work(chunk) over `concurrency` contiguous chunks of range(n) in threads; wall seconds."""
    chunks = _split(n, concurrency)
    barrier = threading.Barrier(len(chunks) + 1)

    def job(chunk: range):
        barrier.wait()
        return work(chunk)

    with ThreadPoolExecutor(max_workers=len(chunks)) as pool:
        futures = [pool.submit(job, c) for c in chunks]
        barrier.wait()
        t0 = time.perf_counter()
        results = [f.result() for f in futures]
        dt = time.perf_counter() - t0
    return dt, results


def _batches(chunk: range, batch: int):
    for i in range(chunk.start, chunk.stop, batch):
        yield range(i, min(i + batch, chunk.stop))


def drop_page_cache(paths: list[str]) -> str | None:
    """Evict the files' pages from the page cache. Returns the method used, or None."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    try:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "fadvise_dontneed"
    except (OSError, AttributeError):
        return None


def _cpu_other() -> float:
    """Load average minus our own running threads is not observable cheaply; report loadavg."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


# -- the benchmark ------------------------------------------------------------------------------


def bench_hicache_file(
    root: str,
    page_bytes: int,
    num_pages: int,
    concurrency: int,
    dtype: torch.dtype = torch.bfloat16,
    *,
    warm_repeats: int = 3,
    cold: bool = True,
    controller_path: bool = True,
    seed: int = 0,
) -> dict:
    """Write `num_pages` pages of `page_bytes` through SGLang's HiCacheFile, read them back warm and
    cold from `concurrency` threads, verify the bytes, and return GB/s figures (GB = 1e9 B)."""
    sglang_version, _, _, _, batch = _import_sglang()
    esize = torch.empty(0, dtype=dtype).element_size()
    if page_bytes % esize:
        raise ValueError(f"page_bytes {page_bytes} is not a multiple of {dtype} size {esize}")
    elems = page_bytes // esize
    total = page_bytes * num_pages

    env_dir = os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)  # would override root
    if env_dir is not None:
        print(f"note: ignoring SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR={env_dir}", file=sys.stderr)
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, f"hicache-bench-{uuid.uuid4().hex[:8]}")

    # Source pages: rows of one host buffer, as HostKVCache page_first keeps them
    # (get_data_page returns kv_buffer[index].flatten(), a contiguous view).
    gen = torch.Generator().manual_seed(seed)
    src = torch.randn(num_pages, elems, generator=gen, dtype=torch.float32).to(dtype)
    src_u8 = src.view(torch.uint8)
    dst = torch.zeros_like(src)  # preallocated, touched host buffer to read into
    dst_u8 = dst.view(torch.uint8)
    keys = _keys(num_pages, f"{page_bytes}:{concurrency}:{seed}")

    out: dict[str, Any] = {
        "sglang": sglang_version,
        "page_bytes": page_bytes,
        "num_pages": num_pages,
        "total_bytes": total,
        "concurrency": concurrency,
        "dtype": str(dtype).replace("torch.", ""),
        "batch_size": batch,
        "loadavg_start": _cpu_other(),
    }
    try:
        backend = make_backend(path)
        out["backend"] = type(backend).__name__
        out["eviction_enabled"] = bool(getattr(getattr(backend, "_evictor", None), "enabled", False))
        out["metadata_cache"] = getattr(backend, "metadata_cache", None) is not None

        # write
        def write(chunk: range) -> bool:
            ok = True
            for b in _batches(chunk, batch):
                ok &= bool(backend.batch_set([keys[i] for i in b], [src[i] for i in b]))
            return ok

        t_write, oks = _run_threads(num_pages, concurrency, write)
        if not all(oks):
            raise RuntimeError("HiCacheFile.batch_set returned False")
        files = [os.path.join(backend.file_path, f"{backend._get_suffixed_key(k)}.bin") for k in keys]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise RuntimeError(f"{len(missing)} page files missing after batch_set, e.g. {missing[0]}")
        t0 = time.perf_counter()
        for f in files:  # ours, not HiCacheFile's: to get a figure comparable to a durable store
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        t_sync = time.perf_counter() - t0
        out["write_gbps"] = total / t_write / GB
        out["write_s"] = t_write
        out["fsync_s"] = t_sync
        out["write_sync_gbps"] = total / (t_write + t_sync) / GB
        out["exists_hits"] = backend.batch_exists(keys)

        # reads into preallocated rows of the host buffer
        def read(chunk: range) -> bool:
            ok = True
            for b in _batches(chunk, batch):
                got = backend.batch_get([keys[i] for i in b], [dst[i] for i in b])
                ok &= all(g is not None for g in got)
            return ok

        def read_pass() -> float:
            dst.zero_()
            dt, oks = _run_threads(num_pages, concurrency, read)
            if not all(oks):
                raise RuntimeError("HiCacheFile.batch_get returned None for some page")
            if not torch.equal(dst_u8, src_u8):
                raise RuntimeError("read-back bytes differ from the written pages")
            return dt

        warm = [read_pass() for _ in range(warm_repeats)]
        out["warm_read_gbps"] = total / statistics.median(warm) / GB
        out["warm_read_runs_gbps"] = [total / t / GB for t in warm]

        if controller_path:
            # HiCacheController._generic_page_get: fresh zeros dummy page per key, batch_get into
            # it, then set_from_flat_data_page -> kv_buffer[index].copy_(data_page).
            def read_ctrl(chunk: range) -> bool:
                ok = True
                for b in _batches(chunk, batch):
                    dummies = [torch.zeros(elems, dtype=dtype) for _ in b]
                    got = backend.batch_get([keys[i] for i in b], dummies)
                    for i, g in zip(b, got):
                        if g is None:
                            ok = False
                            break
                        dst[i].copy_(g.view(dtype))
                return ok

            times = []
            for _ in range(warm_repeats):
                dst.zero_()
                dt, oks = _run_threads(num_pages, concurrency, read_ctrl)
                if not all(oks) or not torch.equal(dst_u8, src_u8):
                    raise RuntimeError("controller-path read failed or differs")
                times.append(dt)
            out["warm_read_controller_gbps"] = total / statistics.median(times) / GB

        if cold:
            method = drop_page_cache(files)
            out["cold_method"] = method
            if method is None:
                out["cold_read_gbps"] = None
            else:
                out["cold_read_gbps"] = total / read_pass() / GB
        else:
            out["cold_method"] = "skipped"
            out["cold_read_gbps"] = None
        out["verified"] = True
        out["loadavg_end"] = _cpu_other()
        return out
    finally:
        shutil.rmtree(path, ignore_errors=True)


class ColdReader:
    """HiCacheFile holding `num_pages` pages written once, read cold again and again: for benchmarks
    that alternate its cold passes with another store's on the same disk (paired, so the disk's
    drift between passes cancels). `cold_pass(drop)` calls `drop` (which must empty the page
    cache), reads every page from `concurrency` threads into preallocated rows, checks the bytes,
    and returns the seconds; `close()` removes the files."""

    def __init__(self, root: str, page_bytes: int, num_pages: int, concurrency: int, seed: int = 0) -> None:
        self.version, _, _, _, self.batch = _import_sglang()
        os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)  # would override root
        self.path = os.path.join(root, f"hicache-cold-{uuid.uuid4().hex[:8]}")
        self.num_pages, self.concurrency = num_pages, concurrency
        gen = torch.Generator().manual_seed(seed)
        self.src = torch.randint(0, 256, (num_pages, page_bytes), dtype=torch.uint8, generator=gen)
        self.dst = torch.zeros_like(self.src)  # touched: time the read, not first-touch faults
        self.keys = _keys(num_pages, f"cold:{page_bytes}:{seed}")
        self.backend = make_backend(self.path)
        for b in _batches(range(num_pages), self.batch):
            if not self.backend.batch_set([self.keys[i] for i in b], [self.src[i] for i in b]):
                raise RuntimeError("HiCacheFile.batch_set returned False")
        os.sync()

    def cold_pass(self, drop: Callable[[], object]) -> float:
        def read(chunk: range) -> bool:
            ok = True
            for b in _batches(chunk, self.batch):
                got = self.backend.batch_get([self.keys[i] for i in b], [self.dst[i] for i in b])
                ok &= all(g is not None for g in got)
            return ok

        self.dst.zero_()
        drop()
        secs, oks = _run_threads(self.num_pages, self.concurrency, read)
        if not all(oks) or not torch.equal(self.dst, self.src):
            raise RuntimeError("HiCacheFile cold pass missed pages or read bytes that differ")
        return secs

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


# -- ceilings (same run, same disk) ---------------------------------------------------------------


def ceilings(root: str, nbytes: int = GiB, chunk: int = 32 * MiB) -> dict:
    """memcpy (numpy copyto) and a raw file's durable write / warm / cold read with readinto into
    a tensor in `chunk` pieces: what HiCacheFile's figures should be judged against."""
    a = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    b = np.empty_like(a)
    np.copyto(b, a)
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(b, a)
        ts.append(time.perf_counter() - t0)
    res = {"memcpy_gbps": nbytes / statistics.median(ts) / GB}
    os.makedirs(root, exist_ok=True)
    p = os.path.join(root, f"ceiling-{uuid.uuid4().hex[:8]}.bin")
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    mv = memoryview(buf.numpy())
    try:
        t0 = time.perf_counter()
        with open(p, "wb", buffering=0) as f:
            for off in range(0, nbytes, chunk):
                f.write(memoryview(a)[off : off + chunk])
            os.fsync(f.fileno())
        res["file_write_fsync_gbps"] = nbytes / (time.perf_counter() - t0) / GB

        def read_all() -> float:
            t0 = time.perf_counter()
            with open(p, "rb", buffering=0) as f:
                for off in range(0, nbytes, chunk):
                    f.readinto(mv[off : off + chunk])
            return time.perf_counter() - t0

        res["file_warm_read_gbps"] = nbytes / statistics.median([read_all() for _ in range(3)]) / GB
        method = drop_page_cache([p])
        res["file_cold_read_gbps"] = nbytes / read_all() / GB if method else None
        if not np.array_equal(buf.numpy(), a):
            raise RuntimeError("ceiling read-back differs")
    finally:
        try:
            os.remove(p)
        except OSError:
            pass
    return res


def _fmt(x: Any) -> str:
    return "-" if x is None else f"{x:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default="/tmp/peer-hicache")
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[2, 8, 32])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--total-mib", type=int, default=1024)
    ap.add_argument("--warm-repeats", type=int, default=3)
    ap.add_argument("--no-ceilings", action="store_true")
    ap.add_argument("--quick", action="store_true", help="64 MiB per case, 1 warm repeat")
    args = ap.parse_args(argv)
    if args.quick:
        args.total_mib, args.warm_repeats = 64, 1
    try:
        version = _import_sglang()[0]
    except ImportError as e:
        print(e, file=sys.stderr)
        return 2

    t_start = time.perf_counter()
    print(f"sglang {version}, torch {torch.__version__}, {os.cpu_count()} CPUs, root {args.root}")
    try:
        if not args.no_ceilings:
            c = ceilings(args.root, nbytes=min(GiB, args.total_mib * MiB))
            print(
                "ceilings (GB/s): memcpy {} | raw file write+fsync {} | warm readinto {} | cold readinto {}".format(
                    _fmt(c["memcpy_gbps"]),
                    _fmt(c["file_write_fsync_gbps"]),
                    _fmt(c["file_warm_read_gbps"]),
                    _fmt(c["file_cold_read_gbps"]),
                )
            )
        hdr = (
            f"{'page':>7} {'pages':>6} {'conc':>4} | {'write':>6} {'wr+fsync':>8} | "
            f"{'warm':>6} {'warm ctl':>8} | {'cold':>6}  (GB/s; {'verified'})"
        )
        print(hdr)
        print("-" * len(hdr))
        for mib in args.sizes_mib:
            page = mib * MiB
            n = max(1, (args.total_mib * MiB) // page)
            for conc in args.concurrency:
                r = bench_hicache_file(args.root, page, n, conc, warm_repeats=args.warm_repeats)
                print(
                    f"{mib:>4}MiB {n:>6} {conc:>4} | {_fmt(r['write_gbps']):>6} {_fmt(r['write_sync_gbps']):>8} | "
                    f"{_fmt(r['warm_read_gbps']):>6} {_fmt(r.get('warm_read_controller_gbps')):>8} | "
                    f"{_fmt(r['cold_read_gbps']):>6}  ({'ok' if r['verified'] else 'FAIL'}; cold via {r['cold_method']};"
                    f" load {r['loadavg_start']:.1f}->{r['loadavg_end']:.1f})",
                    flush=True,
                )
    finally:
        try:
            os.rmdir(args.root)  # only if empty: never remove what others put there
        except OSError:
            pass
    print(f"total {time.perf_counter() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
