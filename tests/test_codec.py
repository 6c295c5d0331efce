from __future__ import annotations

import pytest
import torch

from agentstate import codec
from agentstate.errors import AgentStateError, CorruptDataError, SpecMismatchError
from tests.conftest import SPEC4, bits_equal, random_kv

FP = SPEC4.fingerprint
DTYPES = ["bfloat16", "float16", "float32", "float8_e4m3fn"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_bit_exact_from_strided_slice(dtype: str) -> None:
    spec = SPEC4.model_copy(update={"dtype": dtype})
    kv = random_kv(spec, 100, seed=3)
    chunk = kv[:, :, 10:74]  # strided: encode gathers it layer-major
    buf = codec.encode(chunk, FP)
    assert len(buf) == codec.HEADER_SIZE + chunk.numel() * chunk.element_size()
    out = codec.decode(bytes(buf), fingerprint=FP, dtype=chunk.dtype, shape=tuple(chunk.shape))
    assert bits_equal(out, chunk)
    dest = torch.zeros_like(kv)
    codec.decode_into(buf, dest[:, :, 10:74], fingerprint=FP)
    assert bits_equal(dest[:, :, 10:74], chunk)
    assert not dest[:, :, :10].view(torch.uint8).any()


def test_payload_is_raw_layer_major_tensor_memory() -> None:
    kv = random_kv(SPEC4, 8)
    buf = codec.encode(kv, FP)
    assert bytes(buf[codec.HEADER_SIZE :]) == kv.contiguous().view(torch.uint8).numpy().tobytes()
    assert bytes(buf[:4]) == codec.MAGIC


def _encoded() -> tuple[bytearray, torch.Tensor]:
    kv = random_kv(SPEC4, 16, seed=1)
    return codec.encode(kv, FP), kv


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
        codec.decode(buf, fingerprint=FP, dtype=kv.dtype, shape=tuple(kv.shape))


def test_expectations_are_checked() -> None:
    buf, kv = _encoded()
    with pytest.raises(SpecMismatchError):
        codec.decode(buf, fingerprint="0" * 32, dtype=kv.dtype)
    with pytest.raises(CorruptDataError, match="dtype"):
        codec.decode(buf, fingerprint=FP, dtype=torch.float16)
    with pytest.raises(CorruptDataError, match="shape"):
        codec.decode(buf, fingerprint=FP, dtype=kv.dtype, shape=(4, 2, 15, 2, 64))
    dest = torch.empty((4, 2, 17, 2, 64), dtype=kv.dtype)
    with pytest.raises(AgentStateError):
        codec.decode_into(buf, dest, fingerprint=FP)


def test_unverified_decode_still_checks_structure() -> None:
    buf, kv = _encoded()
    buf[-1] ^= 0xFF
    out = codec.decode(buf, fingerprint=FP, dtype=kv.dtype, verify=False)  # trusted DRAM path
    assert out.shape == kv.shape
    buf[0:4] = b"NOPE"
    with pytest.raises(CorruptDataError):
        codec.decode(buf, fingerprint=FP, dtype=kv.dtype, verify=False)
