from __future__ import annotations

import pytest
import torch
import xxhash

from agentstate import codec
from agentstate.errors import AgentStateError, CorruptDataError, SpecMismatchError
from tests.conftest import SPEC4, bits_equal, random_kv

FP = SPEC4.fingerprint
KEY = f"c/{FP}/{'1' * 64}"
OTHER = f"c/{FP}/{'2' * 64}"
DTYPES = ["bfloat16", "float16", "float32", "float8_e4m3fn"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_bit_exact_from_strided_slice(dtype: str) -> None:
    spec = SPEC4.model_copy(update={"dtype": dtype})
    kv = random_kv(spec, 100, seed=3)
    chunk = kv[:, :, 10:74]  # strided: encode gathers it layer-major
    buf = codec.encode(chunk, FP, key=KEY)
    assert len(buf) == codec.HEADER_SIZE + chunk.numel() * chunk.element_size()
    out = codec.decode(bytes(buf), key=KEY, fingerprint=FP, dtype=chunk.dtype, shape=tuple(chunk.shape))
    assert bits_equal(out, chunk)
    dest = torch.zeros_like(kv)
    codec.decode_into(buf, dest[:, :, 10:74], key=KEY, fingerprint=FP)
    assert bits_equal(dest[:, :, 10:74], chunk)
    assert not dest[:, :, :10].view(torch.uint8).any()


def test_payload_is_raw_layer_major_tensor_memory() -> None:
    kv = random_kv(SPEC4, 8)
    buf = codec.encode(kv, FP, key=KEY)
    assert bytes(buf[codec.HEADER_SIZE :]) == kv.contiguous().view(torch.uint8).numpy().tobytes()
    assert bytes(buf[:4]) == codec.MAGIC


def _encoded() -> tuple[bytearray, torch.Tensor]:
    kv = random_kv(SPEC4, 16, seed=1)
    return codec.encode(kv, FP, key=KEY), kv


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda b: b.__setitem__(slice(0, 4), b"XXXX"), id="magic"),
        pytest.param(lambda b: b.__setitem__(4, 9), id="version"),
        pytest.param(lambda b: b.__setitem__(6, 77), id="dtype-code"),
        pytest.param(lambda b: b.__setitem__(24, b[24] ^ 1), id="shape"),
        pytest.param(lambda b: b.__setitem__(len(b) - 1, b[-1] ^ 0x10), id="payload-bit"),
        pytest.param(lambda b: b.__setitem__(60, b[60] ^ 1), id="checksum"),
        pytest.param(lambda b: b.__setitem__(52, 1), id="reserved"),
        pytest.param(lambda b: b.__delitem__(slice(len(b) - 100, len(b))), id="truncated"),
        pytest.param(lambda b: b.__delitem__(slice(30, len(b))), id="truncated-header"),
        pytest.param(lambda b: b.extend(b"\0"), id="trailing-bytes"),
    ],
)
def test_damaged_bytes_raise_corrupt(mutate) -> None:  # type: ignore[no-untyped-def]
    buf, kv = _encoded()
    mutate(buf)
    with pytest.raises(CorruptDataError):
        codec.decode(buf, key=KEY, fingerprint=FP, dtype=kv.dtype, shape=tuple(kv.shape))


def test_expectations_are_checked() -> None:
    buf, kv = _encoded()
    with pytest.raises(SpecMismatchError):
        codec.decode(buf, key=KEY, fingerprint="0" * 32, dtype=kv.dtype)
    with pytest.raises(CorruptDataError, match="dtype"):
        codec.decode(buf, key=KEY, fingerprint=FP, dtype=torch.float16)
    with pytest.raises(CorruptDataError, match="shape"):
        codec.decode(buf, key=KEY, fingerprint=FP, dtype=kv.dtype, shape=(4, 2, 15, 2, 64))
    dest = torch.empty((4, 2, 17, 2, 64), dtype=kv.dtype)
    with pytest.raises(AgentStateError):
        codec.decode_into(buf, dest, key=KEY, fingerprint=FP)


def test_unverified_decode_still_checks_structure() -> None:
    buf, kv = _encoded()
    buf[-1] ^= 0xFF
    out = codec.decode(buf, key=KEY, fingerprint=FP, dtype=kv.dtype, verify=False)  # trusted DRAM path
    assert out.shape == kv.shape
    buf[0:4] = b"NOPE"
    with pytest.raises(CorruptDataError):
        codec.decode(buf, key=KEY, fingerprint=FP, dtype=kv.dtype, verify=False)


# -- a value is bound to the key it is stored under ---------------------------------------------


def test_checksum_seed_covers_header_and_key() -> None:
    buf, _ = _encoded()
    seed = xxhash.xxh3_64_intdigest(bytes(buf[:56]) + KEY.encode())
    assert int.from_bytes(buf[56:64], "little") == xxhash.xxh3_64_intdigest(bytes(buf[codec.HEADER_SIZE :]), seed=seed)
    assert int.from_bytes(buf[4:6], "little") == codec.FORMAT_VERSION == 2


@pytest.mark.parametrize(
    "other",
    [OTHER, KEY[:-1], KEY + "0", KEY.upper(), f"t/{FP}/alice/s/1.00", f"p/{FP}/64/0/{'1' * 64}"],
    ids=["other-chunk", "prefix", "extended", "case", "tail", "page"],
)
def test_a_valid_value_under_another_key_is_refused(other: str) -> None:
    buf, kv = _encoded()
    with pytest.raises(CorruptDataError, match="stored under another key"):
        codec.decode(buf, key=other, fingerprint=FP, dtype=kv.dtype, shape=tuple(kv.shape))
    with pytest.raises(CorruptDataError, match="stored under another key"):
        codec.decode_into(buf, torch.empty_like(kv), key=other, fingerprint=FP)
    assert bits_equal(codec.decode(buf, key=KEY, fingerprint=FP, dtype=kv.dtype), kv)


def test_same_kv_under_two_keys_gives_two_values_each_bound_to_its_own() -> None:
    kv = random_kv(SPEC4, 16, seed=1)
    a, b = codec.encode(kv, FP, key=KEY), codec.encode(kv, FP, key=OTHER)
    assert a[:56] == b[:56] and a[64:] == b[64:] and a[56:64] != b[56:64]  # only the checksum differs
    assert bits_equal(codec.decode(b, key=OTHER, fingerprint=FP, dtype=kv.dtype), kv)
    with pytest.raises(CorruptDataError):
        codec.decode(a, key=OTHER, fingerprint=FP, dtype=kv.dtype)


def _v1(kv: torch.Tensor) -> bytearray:
    """A version-1 frame, as the previous build wrote it (checksum seeded with the header only)."""
    buf = codec.encode(kv, FP, key=KEY)
    buf[4:6] = (1).to_bytes(2, "little")
    seed = xxhash.xxh3_64_intdigest(bytes(buf[:56]))
    buf[56:64] = xxhash.xxh3_64_intdigest(bytes(buf[codec.HEADER_SIZE :]), seed=seed).to_bytes(8, "little")
    return buf


def test_version_1_frames_are_an_unsupported_format() -> None:
    kv = random_kv(SPEC4, 16, seed=1)
    old = _v1(kv)
    for verify in (True, False):
        with pytest.raises(CorruptDataError, match="unsupported chunk format version 1"):
            codec.decode(old, key=KEY, fingerprint=FP, dtype=kv.dtype, verify=verify)
    with pytest.raises(CorruptDataError, match="version 1"):
        codec.read_header(old)


def test_the_key_is_required() -> None:
    kv = random_kv(SPEC4, 16, seed=1)
    buf = codec.encode(kv, FP, key=KEY)
    with pytest.raises(TypeError):
        codec.encode(kv, FP)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        codec.encode(kv, FP, bytearray(len(buf)))  # type: ignore[misc]  # the old positional `out`
    with pytest.raises(TypeError):
        codec.decode(buf, fingerprint=FP, dtype=kv.dtype)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        codec.decode_into(buf, torch.empty_like(kv), fingerprint=FP)  # type: ignore[call-arg]
    for bad in ("", None, b"c/x"):
        with pytest.raises(TypeError, match="key"):
            codec.encode(kv, FP, key=bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="key"):
            codec.decode(buf, key=bad, fingerprint=FP, dtype=kv.dtype, verify=False)  # type: ignore[arg-type]
