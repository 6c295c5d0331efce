"""Chunk bytes: a 64-byte self-describing header followed by the raw tensor memory.

Layout (little endian)::

    0   4s  magic b"ASKV"
    4   H   format version
    6   B   dtype code
    7   B   layout code (0 = canonical, layer-major [layers, planes, tokens, heads, dim]; others in
            agentstate.layouts: an engine's own block layout, kept where converting costs its loads)
    8   16s spec fingerprint (raw)
    24  5I  shape
    44  Q   payload length in bytes
    52  I   flags: bit 0 (FLAG_LOSSY) the payload is a lossy reconstruction (an fp8 tier's decode),
            not the bytes the engine stored; other bits are reserved (0), refused when set
    56  Q   xxh3_64 of the payload, seeded with xxh3_64(bytes 0..56 + the key, UTF-8)
    64  ... payload: exactly the memory of the contiguous tensor

The seed covers the header fields and the key the value is stored under, so a value is bound to
its key: a valid chunk copied or swapped under another key fails its checksum like a damaged one
(it would otherwise be served as the other chunk's KV). Every encode and decode names the key.
Version 1 (checksum not bound to a key) is refused as an unsupported format: a miss, recomputed.

The lossy flag travels with the bytes: a chunk an fp8 tier gave back is re-encoded with it, so a
copy promoted to host memory or written to another tier still says it is not the original, and a
restore can report whether what it served is bit-exact (`ResumeResult.exact`).

The shape field is always the canonical shape. A payload in another layout (layouts.py) holds the
same elements in the engine's order: `decode` gives every reader canonical KV (a converted copy),
`decode_native` gives the engine whose layout it is a view of its own memory.

No pickle and no torch.load: decoding only reinterprets bytes after every field checks out, and a
buffer whose checksum fails never reaches a caller.
"""

from __future__ import annotations

import functools
import mmap
import struct
import warnings
from typing import TYPE_CHECKING, NamedTuple

import xxhash

from agentstate import layouts
from agentstate.errors import CorruptDataError, SpecMismatchError
from agentstate.layouts import NativeKV
from agentstate.spec import ITEMSIZE

if TYPE_CHECKING:
    import torch

MAGIC = b"ASKV"
FORMAT_VERSION = 2
HEADER_SIZE = 64
LAYOUT_CANONICAL = layouts.CANONICAL
FLAG_LOSSY = 1
"""Header flag: the payload is a lossy reconstruction of what was stored (see the module docstring)."""
_KNOWN_FLAGS = FLAG_LOSSY
_FIELDS = struct.Struct("<4sHBB16s5IQI")  # bytes 0..56
_CHECKSUM = struct.Struct("<Q")  # bytes 56..64
_FLAGS = struct.Struct("<I")  # bytes 52..56

DTYPE_CODE_NAMES: dict[str, int] = {
    "float32": 1, "float16": 2, "bfloat16": 3, "float8_e4m3fn": 4, "float8_e5m2": 5, "uint8": 6,
}  # fmt: skip
"""The header's dtype codes, by dtype name: known without torch, so that reading a catalog (ls,
inspect, stats) imports no torch; the torch dtypes are resolved on the first chunk encoded or read."""


@functools.cache
def _dtypes() -> tuple[dict[torch.dtype, int], dict[int, torch.dtype]]:
    import torch

    codes = {getattr(torch, name): code for name, code in DTYPE_CODE_NAMES.items()}
    return codes, {code: dtype for dtype, code in codes.items()}


_CODE_NAMES = {code: name for name, code in DTYPE_CODE_NAMES.items()}


def dtype_code(dtype: torch.dtype) -> int | None:
    """The header code of `dtype`, None for a dtype a chunk cannot hold."""
    return _dtypes()[0].get(dtype)


def code_dtype(code: int) -> torch.dtype | None:
    """The dtype of a header code, None for an unknown code."""
    return _dtypes()[1].get(code)


# Backends hand out read-only views (LMDB's mmap); we only ever read through them.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


Buffer = memoryview | bytes | bytearray | mmap.mmap


class ChunkHeader(NamedTuple):
    fingerprint: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    payload_len: int
    checksum: int
    lossy: bool = False
    """the payload is a lossy reconstruction (FLAG_LOSSY), not bit-exact to what was stored"""
    layout: int = LAYOUT_CANONICAL
    """the payload's layout code (layouts.py); `shape` is canonical whatever it is"""


def encoded_size(nbytes: int) -> int:
    return HEADER_SIZE + nbytes


def _key_bytes(key: str) -> bytes:
    if not isinstance(key, str) or not key:
        raise TypeError(f"a chunk is bound to the key it is stored under: key must be a non-empty str, got {key!r}")
    return key.encode()


def _checksum(header: memoryview, payload: memoryview, key: bytes) -> int:
    seed = xxhash.xxh3_64()
    seed.update(header[: _FIELDS.size])
    seed.update(key)
    return xxhash.xxh3_64_intdigest(payload, seed=seed.intdigest())


def payload_bytes(kv: torch.Tensor | NativeKV) -> int:
    """The payload size of a chunk of canonical or native KV."""
    return kv.nbytes() if isinstance(kv, NativeKV) else kv.numel() * kv.element_size()


def encode(
    kv: torch.Tensor | NativeKV, fingerprint: str, *, key: str, out: bytearray | mmap.mmap | None = None,
    lossy: bool = False,
) -> bytearray | mmap.mmap:  # fmt: skip
    """Encode one chunk of canonical KV (any strides, CPU or not), or of KV in an engine's own layout
    (`NativeKV`, stored as it is), into self-describing bytes, bound to `key`, the key the value will
    be stored under (decode must name the same key). `lossy` marks `kv` as a lossy reconstruction
    (FLAG_LOSSY), so no reader takes it for the original.

    Writes into `out` (exactly `encoded_size` bytes) or a fresh buffer. The single copy made here
    is also the gather that makes a strided slice layer-major.
    """
    import torch

    bound = _key_bytes(key)
    layout, data = (kv.layout, kv.data) if isinstance(kv, NativeKV) else (LAYOUT_CANONICAL, kv)
    shape = tuple(kv.shape)
    code = dtype_code(data.dtype)
    if code is None:
        raise CorruptDataError(f"dtype {data.dtype} cannot be encoded")
    if len(shape) != 5:
        raise CorruptDataError(f"canonical KV has 5 dims, got {len(shape)}")
    layouts.check_layout(layout, shape)
    if tuple(data.shape) != layouts.native_shape(layout, shape):
        raise CorruptDataError(f"payload {tuple(data.shape)} is not layout {layout:#x} of {shape}")
    nbytes = data.numel() * data.element_size()
    if out is None:
        out = bytearray(HEADER_SIZE + nbytes)
    elif len(out) != HEADER_SIZE + nbytes:
        raise CorruptDataError(f"output buffer is {len(out)} bytes, the chunk needs {HEADER_SIZE + nbytes}")
    if nbytes:
        dest = torch.frombuffer(out, dtype=data.dtype, offset=HEADER_SIZE, count=data.numel()).view(data.shape)
        dest.copy_(data)
    view = memoryview(out)
    _FIELDS.pack_into(
        out, 0, MAGIC, FORMAT_VERSION, code, layout,
        bytes.fromhex(fingerprint), *shape, nbytes, FLAG_LOSSY if lossy else 0,
    )  # fmt: skip
    _CHECKSUM.pack_into(out, _FIELDS.size, _checksum(view, view[HEADER_SIZE:], bound))
    return out


def is_lossy(buf: Buffer) -> bool:
    """Whether a chunk (already checked by `decode`) carries FLAG_LOSSY: its payload is not bit-exact."""
    return len(buf) >= HEADER_SIZE and bool(_FLAGS.unpack_from(buf, 52)[0] & FLAG_LOSSY)


def _fields(view: memoryview) -> tuple[str, str, tuple[int, ...], int, int, bool, int]:
    """Parse and check the header fields that need no expectations (magic, version, length, layout),
    with no torch: (fingerprint, dtype name, shape, payload length, checksum, lossy, layout)."""
    if len(view) < HEADER_SIZE:
        raise CorruptDataError(f"chunk truncated: {len(view)} bytes is shorter than the {HEADER_SIZE}-byte header")
    magic, version, dcode, layout, fp, *rest = _FIELDS.unpack_from(view, 0)
    shape, payload_len, flags = tuple(rest[:5]), rest[5], rest[6]
    if magic != MAGIC:
        raise CorruptDataError(f"bad magic {magic!r}: not an agentstate chunk")
    if version != FORMAT_VERSION:
        raise CorruptDataError(f"unsupported chunk format version {version} (this build reads {FORMAT_VERSION})")
    name = _CODE_NAMES.get(dcode)
    if name is None:
        raise CorruptDataError(f"unknown dtype code {dcode}")
    layouts.check_layout(layout, shape)
    if flags & ~_KNOWN_FLAGS:
        raise CorruptDataError(f"unknown header flags {flags:#x}")
    numel = shape[0] * shape[1] * shape[2] * shape[3] * shape[4]
    if numel * ITEMSIZE[name] != payload_len:
        raise CorruptDataError(f"payload length {payload_len} does not match shape {shape} of {name}")
    if len(view) != HEADER_SIZE + payload_len:
        raise CorruptDataError(f"chunk is {len(view)} bytes, header says {HEADER_SIZE + payload_len}")
    (checksum,) = _CHECKSUM.unpack_from(view, _FIELDS.size)
    return fp.hex(), name, shape, payload_len, checksum, bool(flags & FLAG_LOSSY), layout


def intact(buf: Buffer, *, key: str) -> bool:
    """Whether `buf` is a whole, undamaged value written under `key`, whatever spec it holds: what
    tells a value of another spec (a hybrid state, another slice of heads: not this reader's, never
    to be dropped as damaged) from a damaged one."""
    view = memoryview(buf)
    try:
        _, _, _, _, checksum, _, _ = _fields(view)
    except CorruptDataError:
        return False
    return _checksum(view, view[HEADER_SIZE:], _key_bytes(key)) == checksum


def read_header(buf: Buffer) -> ChunkHeader:
    """Parse and check the header fields that need no expectations (magic, version, length)."""
    fp, name, shape, payload_len, checksum, lossy, layout = _fields(memoryview(buf))
    dtype = code_dtype(DTYPE_CODE_NAMES[name])
    assert dtype is not None  # every name of DTYPE_CODE_NAMES is a torch dtype
    return ChunkHeader(fp, dtype, shape, payload_len, checksum, lossy, layout)


def check(
    buf: Buffer, *, key: str, fingerprint: str, dtype: str, shape: tuple[int, ...] | None = None
) -> tuple[int, ...]:
    """Everything `decode` checks, `dtype` by name, without building a tensor (so without torch):
    the chunk's shape, or the typed error `decode` would raise. For `agentstate verify`."""
    return _checked(memoryview(buf), _key_bytes(key), fingerprint, dtype, shape, verify=True)


def _checked(
    view: memoryview, bound: bytes, fingerprint: str, dtype: str, shape: tuple[int, ...] | None, *, verify: bool
) -> tuple[int, ...]:
    """The checks of `check` and `decode`: the header, then what the reader expects of it, then
    (with `verify`) the checksum bound to the key. Returns the chunk's shape."""
    fp, name, got, _, checksum, _, _ = _fields(view)
    if fp != fingerprint:
        raise SpecMismatchError(f"chunk belongs to spec {fp}, not {fingerprint}")
    if name != dtype:
        raise CorruptDataError(f"chunk dtype {name} is not the expected {dtype}")
    if shape is not None and got != tuple(shape):
        raise CorruptDataError(f"chunk shape {got} is not the expected {tuple(shape)}")
    if verify and _checksum(view, view[HEADER_SIZE:], bound) != checksum:
        raise CorruptDataError("chunk checksum mismatch (damaged, or stored under another key: not this key's value)")
    return got


def decode(
    buf: Buffer,
    *,
    key: str,
    fingerprint: str,
    dtype: torch.dtype,
    shape: tuple[int, ...] | None = None,
    verify: bool = True,
) -> torch.Tensor:
    """Check `buf`, read under `key`, completely and return canonical KV: a zero-copy tensor view
    over its payload, or, for a payload in an engine's own layout, a canonical copy of it (the
    store's reads count those: `layout_conversions`).

    The view shares memory with `buf`: copy out of it before the buffer is reused or released.
    `verify=False` skips only the checksum (and so the key binding), for bytes this process
    produced and kept in DRAM.
    """
    got = decode_native(buf, key=key, fingerprint=fingerprint, dtype=dtype, shape=shape, verify=verify)
    if isinstance(got, NativeKV):
        return layouts.to_canonical(got.data, got.layout, got.shape)
    return got


def decode_native(
    buf: Buffer, *, key: str, fingerprint: str, dtype: torch.dtype, shape: tuple[int, ...] | None = None,
    verify: bool = True,
) -> torch.Tensor | NativeKV:  # fmt: skip
    """`decode` without the conversion: a canonical view, or a `NativeKV` whose data is a zero-copy
    view of the payload in its own layout (for the engine that keeps that layout)."""
    import torch

    view = memoryview(buf)
    code = dtype_code(dtype)
    name = _CODE_NAMES[code] if code is not None else str(dtype)  # a dtype no chunk holds matches none
    got = _checked(view, _key_bytes(key), fingerprint, name, shape, verify=verify)
    layout = view[7]
    if len(view) == HEADER_SIZE:
        data = torch.empty(layouts.native_shape(layout, got), dtype=dtype)
    else:
        data = torch.frombuffer(view[HEADER_SIZE:], dtype=dtype).view(layouts.native_shape(layout, got))
    return data if layout == LAYOUT_CANONICAL else NativeKV(layout, data, got)


def decode_into(buf: Buffer, dest: torch.Tensor, *, key: str, fingerprint: str, verify: bool = True) -> None:
    """Check `buf` (read under `key`) against `dest`'s shape and dtype, then copy its payload into
    `dest` (any strides)."""
    src = decode(buf, key=key, fingerprint=fingerprint, dtype=dest.dtype, shape=tuple(dest.shape), verify=verify)
    dest.copy_(src)
