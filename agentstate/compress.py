"""Compressed frames: how a tier that opts in (`TierConfig.compression`) stores a value.

A frame wraps one stored value (an encoded chunk, see `agentstate.codec`) and is self-describing::

    0   4s  magic b"ASCZ"
    4   B   frame version (1)
    5   B   quantizer: 0 none (lossless), 1 fp8 (float8_e4m3fn with per-(layer, plane, head) scales)
    6   B   entropy coder: 0 none, 1 zstd, 2 lz4 (block)
    7   B   byte-plane shuffle element size of the lossless stage (1: none, 2: bf16/fp16, 4: fp32)
    8   Q   original length: the value served after decoding
    16  Q   stage length: the bytes the entropy coder must give back (the shuffled or quantized stage)
    24  Q   payload length (the compressed bytes after this header)
    32  Q   xxh3_64 of the payload, seeded with xxh3_64(bytes 0..32 + the key, UTF-8)
    40  ... payload

Why this shape: the checksum is over the compressed bytes, so damage is found before any
decompressor runs, and it is bound to the key like the chunk codec's, so a frame copied under
another key is refused (this matters for fp8, whose decoder re-encodes the chunk under the key it
is read with). The declared original length is bounded (by the caller's `limit`, the largest valid
value for that key, e.g. a chunk's encoded size; else `MAX_VALUE_BYTES`), the stage length is at
most the original length, and the decoders are given exactly the stage length as their output
limit, so a forged frame (a "bomb": a few KiB with a valid checksum declaring 1 GiB) is refused
before any decoder runs or any output is allocated when it declares more than its key can hold, and
otherwise makes a decoder allocate at most what the key can hold; anything that does not come out
at exactly that length is CorruptDataError: a miss, recomputed, never wrong bytes.

Lossless modes shuffle the chunk payload into byte planes (all high bytes of the bf16 elements,
then all low bytes): exponents cluster, so zstd/lz4 find runs they cannot find interleaved. The
chunk codec's own key-bound checksum is kept inside, so a lossless decode is verified twice.
A value that does not shrink is stored as it is (an unframed chunk starts with the codec's
magic), which also lets a tier that turns compression on keep reading what it stored before.

zstandard and lz4 are imported only when a tier uses them (the `compress` extra).
"""

from __future__ import annotations

import importlib
import struct
import threading
from types import ModuleType
from typing import Any, Literal

import numpy as np
import torch
import xxhash

from agentstate import codec
from agentstate.errors import AgentStateError, CorruptDataError, InvalidArgumentError, MissingDependencyError

Method = Literal["none", "zstd", "lz4", "fp8", "fp8+zstd"]
MAGIC = b"ASCZ"
VERSION = 1
_FIELDS = struct.Struct("<4sBBBBQQQ")  # bytes 0..32
_SUM = struct.Struct("<Q")
HEADER_SIZE = _FIELDS.size + _SUM.size
MAX_VALUE_BYTES = 1 << 30
"""Bound of a frame's declared lengths: a chunk is tens of MiB; nothing stored is near 1 GiB."""
ZSTD_LEVEL = 1
"""KV is float data: higher zstd levels cost several times the CPU for a ratio within ~2%."""
QUANT_NONE, QUANT_FP8 = 0, 1
ENTROPY: dict[str, int] = {"none": 0, "zstd": 1, "lz4": 2}
METHODS: dict[str, tuple[int, str]] = {
    "zstd": (QUANT_NONE, "zstd"), "lz4": (QUANT_NONE, "lz4"),
    "fp8": (QUANT_FP8, "none"), "fp8+zstd": (QUANT_FP8, "zstd"),
}  # fmt: skip
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_FP8_HEAD = struct.Struct("<16sB5I")  # fingerprint, codec dtype code, shape
_FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(FP8).float().numpy()  # byte -> its e4m3 value
_MODULES = {"zstd": "zstandard", "lz4": "lz4.block"}
_local = threading.local()


def _module(coder: str) -> ModuleType:
    """The coder's package, imported on first use; MissingDependencyError names the extra."""
    name = _MODULES[coder]
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise MissingDependencyError(
            f"compression {coder!r} needs {name.partition('.')[0]}, which is not installed:"
            " pip install 'agentstate-kv[compress]'", module=name.partition(".")[0], extra="compress",
        ) from exc  # fmt: skip


def require(method: str) -> None:
    """Fail now (at tier construction), not on the first put, when `method` cannot run here."""
    if method not in METHODS:
        raise InvalidArgumentError(f"unknown compression {method!r}; known: none, {', '.join(METHODS)}")
    coder = METHODS[method][1]
    if coder != "none":
        _module(coder)


def is_frame(view: memoryview | bytes) -> bool:
    """A value starting with the frame magic is decoded as a frame (a truncated one fails there);
    anything else is a plain value the codec checks."""
    return bytes(view[:4]) == MAGIC


# -- stages --------------------------------------------------------------------------------------


def _elem_size(value: memoryview) -> int:
    """Shuffle element size: the chunk's dtype size when `value` is a valid chunk header, else 1."""
    try:
        return codec.read_header(value).dtype.itemsize
    except AgentStateError:
        return 1


def shuffle(value: memoryview, elem: int, out: memoryview) -> None:
    """Copy `value` into `out` with the payload after the codec header split into byte planes."""
    n = (len(value) - codec.HEADER_SIZE) // elem if elem > 1 else 0
    start, end = codec.HEADER_SIZE, codec.HEADER_SIZE + n * elem
    out[:start], out[end:] = value[:start], value[end:]
    if n == 0:
        out[start:end] = value[start:end]
        return
    planes = np.frombuffer(out, np.uint8, n * elem, start).reshape(elem, n)
    src = np.frombuffer(value, np.uint8, n * elem, start)
    if elem == 2:  # shifts of uint16 run ~10x faster than a strided copy here
        word = src.view("<u2")
        np.copyto(planes[0], word, casting="unsafe")
        np.right_shift(word, 8, out=planes[1], casting="unsafe")
    else:
        np.copyto(planes, src.reshape(n, elem).T)


def unshuffle(stage: memoryview, elem: int, out: memoryview) -> None:
    """The inverse of `shuffle`: byte planes back into elements, written into `out`."""
    n = (len(stage) - codec.HEADER_SIZE) // elem if elem > 1 else 0
    start, end = codec.HEADER_SIZE, codec.HEADER_SIZE + n * elem
    out[:start], out[end : len(stage)] = stage[:start], stage[end:]
    if n == 0:
        out[start:end] = stage[start:end]
        return
    planes = np.frombuffer(stage, np.uint8, n * elem, start).reshape(elem, n)
    dest = np.frombuffer(out, np.uint8, n * elem, start)
    if elem == 2:
        word = dest.view("<u2")
        np.left_shift(planes[1], 8, out=word, dtype=np.uint16)
        np.bitwise_or(word, planes[0], out=word)
    else:
        np.copyto(dest.reshape(n, elem), planes.T)


def quantize(value: memoryview) -> bytes | None:
    """The fp8 stage of a float chunk: [fingerprint, dtype, shape][fp32 scales [L, P, H]][fp8 data].

    Scales are per (layer, plane, head), amax / 448, so no value is clipped. None when `value` is
    not a float chunk of canonical layout, or holds inf/nan (fp8 has no inf): that chunk is stored
    lossless instead.
    """
    try:
        head = codec.read_header(value)
    except AgentStateError:
        return None
    if head.dtype not in (torch.bfloat16, torch.float16, torch.float32) or head.payload_len == 0:
        return None
    if head.layout != codec.LAYOUT_CANONICAL:  # its scales are per (layer, plane, head) of canonical KV
        return None
    kv = torch.frombuffer(value, dtype=head.dtype, offset=codec.HEADER_SIZE).view(head.shape).float()
    amax = kv.abs().amax(dim=(2, 4))
    if not bool(torch.isfinite(amax).all()):
        return None
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (kv / scale[:, :, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    meta = _FP8_HEAD.pack(bytes.fromhex(head.fingerprint), codec.dtype_code(head.dtype), *head.shape)
    return meta + scale.numpy().tobytes() + q.view(torch.uint8).numpy().tobytes()


def dequantize(stage: memoryview, key: str, original_len: int, out: memoryview) -> None:
    """Rebuild the chunk from its fp8 stage and encode it under `key` into `out`: the codec checksum
    is computed afresh over the dequantized KV, which is what gets served, and the chunk is marked
    lossy (codec.FLAG_LOSSY) so that every copy of it says it is not the bytes that were stored."""
    if len(stage) < _FP8_HEAD.size:
        raise CorruptDataError("fp8 frame: stage shorter than its header")
    fp, dcode, *shape = _FP8_HEAD.unpack_from(stage, 0)
    dtype = codec.code_dtype(dcode)
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise CorruptDataError(f"fp8 frame: dtype code {dcode} is not a float chunk")
    layers, planes, tokens, heads, dim = shape
    scales, numel = layers * planes * heads, layers * planes * tokens * heads * dim
    if _FP8_HEAD.size + 4 * scales + numel != len(stage) or codec.encoded_size(numel * dtype.itemsize) != original_len:
        raise CorruptDataError(f"fp8 frame: shape {tuple(shape)} does not match its lengths")
    scale = torch.frombuffer(stage, dtype=torch.float32, offset=_FP8_HEAD.size, count=scales)
    scale = scale.view(layers, planes, heads)
    q = np.frombuffer(stage, np.uint8, numel, _FP8_HEAD.size + 4 * scales).reshape(shape)
    # fp8 -> fp32 through a 256-entry table: ~3x torch's own conversion on CPU, and the same values
    kv = torch.from_numpy(np.take(_FP8_VALUES, q)).mul_(scale[:, :, None, :, None]).to(dtype)
    codec.encode(kv, fp.hex(), key=key, out=out, lossy=True)  # type: ignore[arg-type]


# -- entropy coders ------------------------------------------------------------------------------


def _zstd_ctx(kind: str) -> object:
    """One zstd context per thread (they are not thread-safe), made on first use."""
    ctx = getattr(_local, kind, None)
    if ctx is None:
        zstd = _module("zstd")
        ctx = zstd.ZstdCompressor(level=ZSTD_LEVEL) if kind == "c" else zstd.ZstdDecompressor()
        setattr(_local, kind, ctx)
    return ctx


def _entropy_encode(coder: str, data: memoryview | bytes) -> bytes | memoryview:
    if coder == "zstd":
        return _zstd_ctx("c").compress(data)  # type: ignore[attr-defined, no-any-return]
    if coder == "lz4":
        return _module("lz4").compress(data, store_size=False)  # type: ignore[no-any-return]
    return data


def _entropy_decode(coder: int, payload: memoryview, stage_len: int) -> bytes | memoryview:
    """Exactly `stage_len` bytes, or CorruptDataError; never allocates more than `stage_len`."""
    data: bytes | memoryview = payload
    try:
        if coder == ENTROPY["none"]:
            pass
        elif coder == ENTROPY["zstd"]:
            zstd = _module("zstd")
            if zstd.frame_content_size(payload) != stage_len:  # zstd allocates what its frame declares
                raise CorruptDataError("zstd frame declares another length than the frame header")
            dctx: Any = _zstd_ctx("d")
            data = dctx.decompress(payload, max_output_size=stage_len, allow_extra_data=False)
        else:
            data = _module("lz4").decompress(payload, uncompressed_size=stage_len)
    except AgentStateError:
        raise
    except Exception as exc:  # zstandard.ZstdError, lz4.block.LZ4BlockError: damaged input
        raise CorruptDataError(f"compressed payload does not decode: {exc}") from exc
    if len(data) != stage_len:
        raise CorruptDataError(f"compressed payload decodes to {len(data)} bytes, the frame says {stage_len}")
    return data


# -- frames --------------------------------------------------------------------------------------


def _checksum(fields: bytes | memoryview, payload: bytes | memoryview, key: str) -> int:
    seed = xxhash.xxh3_64(fields)
    seed.update(key.encode())
    return xxhash.xxh3_64_intdigest(payload, seed=seed.intdigest())


def compress(value: bytes | bytearray | memoryview, key: str, method: str) -> bytes | bytearray | memoryview:
    """The frame to store for `value` under `key`, or `value` itself when framing would not shrink it."""
    quant, coder = METHODS[method]
    view = memoryview(value).cast("B")
    if len(view) > MAX_VALUE_BYTES:
        return value
    stage: bytes | bytearray | None = quantize(view) if quant == QUANT_FP8 else None
    elem = 1
    if stage is None or len(stage) > len(view):  # (a stage never outgrows the value: decoders rely on it)
        quant = QUANT_NONE
        if coder == "none":  # fp8 of a chunk that fp8 cannot hold: stored as it is
            return value
        elem = _elem_size(view)
        stage = bytearray(len(view))
        shuffle(view, elem, memoryview(stage))
    payload = _entropy_encode(coder, memoryview(stage))
    fields = _FIELDS.pack(MAGIC, VERSION, quant, ENTROPY[coder], elem, len(view), len(stage), len(payload))
    if HEADER_SIZE + len(payload) >= len(view):
        return value
    return b"".join((fields, _SUM.pack(_checksum(fields, payload, key)), payload))


def original_length(frame: memoryview | bytes) -> int:
    """The length `decompress` will produce (checked against the bound; the rest is checked there)."""
    fields = _FIELDS.unpack_from(frame, 0)
    if fields[0] != MAGIC or fields[5] > MAX_VALUE_BYTES:
        raise CorruptDataError("not a compressed frame, or one whose declared length is out of bounds")
    return int(fields[5])


def decompress(
    frame: memoryview | bytes, key: str, out: memoryview | None = None, *, limit: int = MAX_VALUE_BYTES
) -> memoryview:
    """Check `frame` (read under `key`) and decode it into `out` (at least the original length) or a
    fresh buffer; returns a view of exactly the original value. Any failure is CorruptDataError.

    `limit`: the longest value `key` can hold (a chunk's encoded size); a frame declaring more is
    refused before its checksum is computed or anything is allocated."""
    view = memoryview(frame).cast("B")
    if len(view) < HEADER_SIZE:
        raise CorruptDataError(f"compressed frame truncated: {len(view)} bytes")
    magic, version, quant, coder, elem, original_len, stage_len, payload_len = _FIELDS.unpack_from(view, 0)
    if magic != MAGIC or version != VERSION:
        raise CorruptDataError(f"not a compressed frame of version {VERSION} (magic {magic!r}, version {version})")
    if quant not in (QUANT_NONE, QUANT_FP8) or coder not in ENTROPY.values() or elem not in (1, 2, 4, 8):
        raise CorruptDataError(f"compressed frame with unknown method ({quant}, {coder}, {elem})")
    lossless = quant == QUANT_NONE
    if original_len > min(limit, MAX_VALUE_BYTES):
        raise CorruptDataError(f"compressed frame declares {original_len} bytes; its key holds at most {limit}")
    if stage_len > original_len or (lossless and stage_len != original_len):
        raise CorruptDataError(f"compressed frame declares out-of-bound lengths ({original_len}, {stage_len})")
    if len(view) != HEADER_SIZE + payload_len:
        raise CorruptDataError(f"compressed frame is {len(view)} bytes, its header says {HEADER_SIZE + payload_len}")
    payload = view[HEADER_SIZE:]
    (expected,) = _SUM.unpack_from(view, _FIELDS.size)
    if _checksum(view[: _FIELDS.size], payload, key) != expected:
        raise CorruptDataError("compressed frame checksum mismatch (damaged, or stored under another key)")
    stage = memoryview(_entropy_decode(coder, payload, stage_len)).cast("B")
    if out is None:
        out = memoryview(bytearray(original_len))
    elif len(out) < original_len:
        raise InvalidArgumentError(f"output buffer of {len(out)} bytes is shorter than the value, {original_len}")
    out = out[:original_len]
    if quant == QUANT_FP8:
        dequantize(stage, key, original_len, out)
    else:
        unshuffle(stage, elem, out)
    return out
