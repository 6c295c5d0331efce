"""ModelSpec: the facts that make two KV states interchangeable, and its fingerprint."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import (
    AfterValidator, BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, field_validator, model_serializer,
    model_validator,
)  # fmt: skip

from agentstate.errors import InvalidArgumentError, KVShapeError

if TYPE_CHECKING:
    import torch

    DTYPES: dict[str, torch.dtype]
    DTYPE_NAMES: dict[torch.dtype, str]

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "uint8": 1}
"""Bytes per element of each dtype a spec may name (the keys of DTYPES, known without torch); uint8 is
raw bytes (a hybrid model's recurrent state as stored, `ModelSpec.state_spec`)."""


def __getattr__(name: str) -> Any:
    """DTYPES and DTYPE_NAMES map names to torch dtypes: built on first use, so that importing a
    spec (the SDK does) needs no torch."""
    if name not in ("DTYPES", "DTYPE_NAMES"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import torch

    dtypes = {n: getattr(torch, n) for n in ITEMSIZE}
    globals().update(DTYPES=dtypes, DTYPE_NAMES={v: k for k, v in dtypes.items()})
    return globals()[name]


def _known_dtype(value: str) -> str:
    if value not in ITEMSIZE:
        raise ValueError(f"dtype must be one of {sorted(ITEMSIZE)}, got {value!r}")
    return value


Dtype = Annotated[str, AfterValidator(_known_dtype)]
"""A dtype by name, one ITEMSIZE knows (a KV dtype, or a state tensor's)."""

MAX_STATE_BYTES = 16 << 30
"""Largest state a layout may describe (a 4B-class SSM hybrid's is tens of MiB, a long sliding window's
hundreds): a spec read from a file or a directory never makes a resume allocate more."""


class StateTensor(BaseModel):
    """One tensor of a hybrid model's state at a position: a linear-attention (Mamba, GatedDeltaNet) or
    short-conv layer's conv or recurrent state, whose size does not depend on the position, or a
    sliding-window layer's KV of its last tokens (`window_dim`: that dimension holds
    `min(position, shape[window_dim])` tokens)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")
    shape: tuple[int, ...] = Field(min_length=1, max_length=8)
    dtype: Dtype
    window_dim: int | None = Field(default=None, ge=0)

    @field_validator("shape")
    @classmethod
    def _positive(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(d <= 0 or d > 1 << 24 for d in value):
            raise ValueError(f"every dimension must be in 1..2**24, got {value}")
        return value

    @model_validator(mode="after")
    def _window_in_shape(self) -> StateTensor:
        if self.window_dim is not None and self.window_dim >= len(self.shape):
            raise ValueError(f"window_dim {self.window_dim} outside shape {self.shape}")
        return self

    def shape_at(self, position: int) -> tuple[int, ...]:
        """Its shape in the state after `position` tokens."""
        if self.window_dim is None:
            return self.shape
        shape = list(self.shape)
        shape[self.window_dim] = min(position, shape[self.window_dim])
        return tuple(shape)

    def nbytes_at(self, position: int) -> int:
        n = ITEMSIZE[self.dtype]
        for d in self.shape_at(position):
            n *= d
        return n


class StateLayout(BaseModel):
    """What a hybrid model carries besides per-token KV (whose layers are the spec's `num_layers`):
    the tensors of its state at a position, in the order they are stored."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tensors: tuple[StateTensor, ...] = Field(min_length=1, max_length=4096)

    @model_validator(mode="after")
    def _unique(self) -> StateLayout:
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError("state tensor names must be unique")
        if self.nbytes_at(1 << 40) > MAX_STATE_BYTES:  # a resume allocates it: bounded by what a model's can be
            raise ValueError(f"a state of {self.nbytes_at(1 << 40)} bytes: at most {MAX_STATE_BYTES}")
        return self

    def nbytes_at(self, position: int) -> int:
        """Bytes of the state after `position` tokens."""
        return sum(t.nbytes_at(position) for t in self.tensors)


class ModelSpec(BaseModel):
    """What KV state is compatible with.

    Canonical KV for this spec is a tensor shaped
    `[num_layers, kv_planes, num_tokens, num_kv_heads, head_dim]` of `dtype`.
    State stored under one fingerprint is never served to another.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_id: str = Field(min_length=1, max_length=256)
    revision: str = Field(default="main", max_length=128)
    dtype: Dtype = "bfloat16"
    num_layers: int = Field(gt=0, le=1024)
    kv_planes: int = Field(default=2, ge=1, le=2, description="2 for K and V, 1 for an MLA latent")
    num_kv_heads: int = Field(gt=0, le=1024)
    head_dim: int = Field(gt=0, le=65536)
    tp_rank: int = Field(default=0, ge=0)
    tp_size: int = Field(default=1, ge=1)
    state: StateLayout | None = Field(
        default=None,
        description="a hybrid model's state besides the KV of its full-attention layers (num_layers): SSM, conv"
        " and sliding-window tensors (docs/design.md, Hybrid models); none for a model of full-attention layers",
    )
    """left out of the stored form and the fingerprint when None, so dense specs read as before"""

    @model_serializer(mode="wrap")
    def _dense_as_before(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if self.state is None:
            data.pop("state", None)
        return data

    @model_validator(mode="after")
    def _rank_in_range(self) -> ModelSpec:
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} must be < tp_size {self.tp_size}")
        return self

    @property
    def fingerprint(self) -> str:
        """32 hex chars of blake2b over the canonical JSON of every field.

        Computed on each access (microseconds): a cached value would survive `model_copy(update=...)`
        and name the wrong spec.
        """
        payload = self.model_dump_json().encode()
        return hashlib.blake2b(payload, digest_size=16, person=b"agentstate-spec").hexdigest()

    @property
    def head_range(self) -> tuple[int, int]:
        """The model's KV heads this rank holds, `[first, end)`: rank r of n holds the r-th of n
        equal slices (vLLM's and SGLang's split when the heads divide by the TP size)."""
        return self.tp_rank * self.num_kv_heads, (self.tp_rank + 1) * self.num_kv_heads

    @property
    def whole(self) -> ModelSpec:
        """The spec of the whole model (every head, TP size 1): what a chunk's key chain is named by,
        so the chunks of one prefix have one name at every TP size (`model_fingerprint`)."""
        if self.tp_size == 1:
            return self
        return self.model_copy(update={"num_kv_heads": self.num_kv_heads * self.tp_size, "tp_rank": 0, "tp_size": 1})

    @property
    def model_fingerprint(self) -> str:
        """The fingerprint of `whole`: equal for every rank of every TP size of one model. A chunk's
        digest chain starts from it; its key's spec segment (`fingerprint`) names the slice it holds."""
        return self.whole.fingerprint

    def slicing(self, tp_size: int, tp_rank: int) -> ModelSpec:
        """Rank `tp_rank` of `tp_size` of this spec's model; InvalidArgumentError when the model's
        heads do not split into `tp_size` equal slices."""
        heads = self.whole.num_kv_heads
        if tp_size < 1 or heads % tp_size or not 0 <= tp_rank < tp_size:
            raise InvalidArgumentError(f"{heads} KV heads do not split into rank {tp_rank} of {tp_size}")
        return self.model_copy(update={"num_kv_heads": heads // tp_size, "tp_rank": tp_rank, "tp_size": tp_size})

    def sources(self) -> list[list[ModelSpec]]:
        """The other slicings of this model whose slices together hold this rank's heads: for each TP
        size the heads divide by (other than this spec's), the ranks overlapping `head_range`, in
        order of the bytes a reader fetches (fewest first, then fewer values). What a reader of
        chunks another TP size stored reads (`agentstate.heads`)."""
        heads = self.whole.num_kv_heads
        first, end = self.head_range
        found = []
        for size in range(1, min(heads, 1024) + 1):
            if heads % size or size == self.tp_size:
                continue
            width = heads // size
            ranks = range(first // width, -(-end // width))
            found.append([self.slicing(size, r) for r in ranks])
        found.sort(key=lambda parts: (len(parts) * parts[0].num_kv_heads, len(parts)))
        return found

    @property
    def state_spec(self) -> ModelSpec | None:
        """How a hybrid state value is encoded: raw bytes, one "token" a byte (`kv_shape(n)` is
        `(1, 1, n, 1, 1)`), under a spec named by this one's fingerprint, so a state value is never
        read as another model's (its key names this spec too). None for a dense spec."""
        if self.state is None:
            return None
        return ModelSpec(model_id=self.model_id, revision=f"state-of-{self.fingerprint}", dtype="uint8", num_layers=1,
                         kv_planes=1, num_kv_heads=1, head_dim=1)  # fmt: skip

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)  # type: ignore[no-any-return]

    @property
    def token_bytes(self) -> int:
        """Bytes of KV one token occupies across all layers and planes."""
        return self.num_layers * self.kv_planes * self.num_kv_heads * self.head_dim * ITEMSIZE[self.dtype]

    def kv_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        return (self.num_layers, self.kv_planes, num_tokens, self.num_kv_heads, self.head_dim)

    def empty_kv(self, num_tokens: int, device: str | torch.device = "cpu") -> torch.Tensor:
        import torch

        return torch.empty(self.kv_shape(num_tokens), dtype=self.torch_dtype, device=device)

    def check_kv(self, kv: object, num_tokens: int | None = None) -> torch.Tensor:
        """Return `kv` if it is canonical KV for this spec (and `num_tokens` long), else raise."""
        import torch

        if not isinstance(kv, torch.Tensor):
            raise KVShapeError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
        if kv.layout != torch.strided or kv.device.type == "meta" or kv.is_quantized:
            raise KVShapeError(f"kv must be a dense tensor holding data, got {kv.layout} on {kv.device}")
        if kv.dtype != self.torch_dtype:
            raise KVShapeError(f"kv dtype {kv.dtype} does not match spec dtype {self.dtype}")
        if kv.dim() != 5:
            raise KVShapeError(f"kv must have 5 dims [layers, planes, tokens, heads, dim], got {tuple(kv.shape)}")
        tokens = kv.shape[2] if num_tokens is None else num_tokens
        if tuple(kv.shape) != self.kv_shape(tokens):
            raise KVShapeError(f"kv shape {tuple(kv.shape)} does not match spec shape {self.kv_shape(tokens)}")
        return kv
