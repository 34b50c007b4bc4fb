"""Codec round trips: nested classes, optionals, unions, tensors, arrays, errors."""

from __future__ import annotations

import enum
import json
import pickle
from typing import Optional

import attrs
import msgpack
import numpy as np
import pytest
import torch

from trillium.actors.codec import INLINE_MAX_BYTES, Codec, CodecError, UnknownMessageType


class Finish(enum.Enum):
    STOP = "stop"
    LENGTH = "length"


class Priority(enum.IntEnum):
    LOW = 0
    HIGH = 1


@attrs.frozen
class Sampling:
    temperature: float
    top_k: int
    stop: tuple[str, ...] = ()


@attrs.frozen
class Block:
    block_id: int
    hashes: list[int]


@attrs.frozen
class Other:
    note: str


@attrs.frozen
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: Sampling
    blocks: list[Block]
    by_name: dict[str, Block]
    by_id: dict[int, list[float]]
    finish: Optional[Finish]
    priority: Priority
    extra: Optional[Sampling]
    payload: bytes
    flag: bool
    either: Block | Other
    maybe_either: Optional[Block | Other] = None


@attrs.frozen
class StepTensors:
    step_id: int
    token_ids: torch.Tensor
    logprobs: Optional[torch.Tensor]
    positions: np.ndarray
    nested: Optional[TensorHolder] = None
    many: list[torch.Tensor] = attrs.field(factory=list)


@attrs.frozen
class TensorHolder:
    name: str
    weight: torch.Tensor


@attrs.frozen
class PerStep:
    step_id: int
    request_ids: list[int]
    new_token_ids: list[int]
    num_computed_tokens: list[int]
    block_ids: tuple[int, ...]


CODEC = Codec([AddRequest, StepTensors, PerStep])


def roundtrip(message):
    return CODEC.decode(CODEC.encode(message))


def make_add_request(**overrides) -> AddRequest:
    fields = dict(
        request_id="req-1",
        prompt_token_ids=[1, 2, 3, 2**40],
        sampling=Sampling(0.7, 50, ("</s>", "\n\n")),
        blocks=[Block(0, [11, 12]), Block(1, [])],
        by_name={"a": Block(7, [1])},
        by_id={3: [0.5, 1.5]},
        finish=Finish.LENGTH,
        priority=Priority.HIGH,
        extra=None,
        payload=b"\x00\xffbytes",
        flag=True,
        either=Other("hi"),
        maybe_either=Block(2, [5]),
    )
    fields.update(overrides)
    return AddRequest(**fields)


def test_nested_roundtrip_is_equal_and_typed():
    message = make_add_request()
    decoded = roundtrip(message)
    assert decoded == message
    assert isinstance(decoded.sampling.stop, tuple)
    assert isinstance(decoded.finish, Finish)
    assert decoded.priority is Priority.HIGH
    assert isinstance(decoded.either, Other)
    assert isinstance(decoded.maybe_either, Block)


def test_optionals_and_defaults():
    message = make_add_request(finish=None, extra=Sampling(1.0, 0), maybe_either=None, by_id={})
    assert roundtrip(message) == message


def test_small_message_has_only_the_envelope_frame():
    frames = CODEC.encode(PerStep(1, [1, 2], [3, 4], [5, 6], (7, 8)))
    assert len(frames) == 1
    decoded = CODEC.decode(frames)
    assert decoded.block_ids == (7, 8)


ALL_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint16, torch.uint32, torch.uint64, torch.float16, torch.bfloat16,
    torch.float32, torch.float64, torch.complex64, torch.complex128,
    torch.float8_e4m3fn, torch.float8_e5m2,
]  # fmt: skip


def make_tensor(dtype: torch.dtype, shape=(3, 5)) -> torch.Tensor:
    values = torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape) % 7 - 2
    if dtype == torch.bool:
        return values > 0
    if dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64):
        return values.abs().to(torch.int64).to(dtype)
    return values.to(dtype)


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.float64}
    if a.dtype.is_complex:
        return torch.equal(torch.view_as_real(a), torch.view_as_real(b))
    return torch.equal(a.view(width[a.dtype.itemsize]), b.view(width[b.dtype.itemsize]))


# Small tensors ride inline in the envelope, large ones as their own frame.
SIZES = {"inline": (3, 5), "frame": (64, INLINE_MAX_BYTES // 64 + 1)}


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_tensor_dtypes_roundtrip_bit_exact(dtype, size):
    tensor = make_tensor(dtype, SIZES[size])
    message = StepTensors(1, tensor, None, np.arange(3))
    frames = CODEC.encode(message)
    assert len(frames) == (2 if size == "frame" else 1)  # positions are always inline
    decoded = CODEC.decode(frames)
    assert same_tensor(decoded.token_ids, tensor)
    assert decoded.logprobs is None


def test_bfloat16_survives_exactly():
    tensor = torch.randn(4, 8).to(torch.bfloat16)
    decoded = roundtrip(StepTensors(0, tensor, tensor[1:], np.zeros(0)))
    assert decoded.token_ids.dtype == torch.bfloat16
    assert same_tensor(decoded.token_ids, tensor)
    assert same_tensor(decoded.logprobs, tensor[1:].contiguous())


@pytest.mark.parametrize("shape", [(0,), (0, 7), (), (1,)])
def test_empty_and_scalar_tensors(shape):
    tensor = make_tensor(torch.float32, shape)
    positions = np.zeros(shape, dtype=np.int32)
    decoded = roundtrip(StepTensors(0, tensor, None, positions))
    assert decoded.token_ids.shape == tensor.shape
    assert same_tensor(decoded.token_ids, tensor)
    assert decoded.positions.shape == positions.shape


def test_nested_optional_and_listed_tensors():
    weight = torch.randn(3, 2)
    message = StepTensors(
        5,
        torch.arange(4),
        torch.randn(2, 2),
        np.arange(6, dtype=np.int64).reshape(2, 3),
        nested=TensorHolder("w", weight),
        many=[torch.ones(2), torch.zeros(3, dtype=torch.int32)],
    )
    decoded = roundtrip(message)
    assert decoded.nested.name == "w"
    assert torch.equal(decoded.nested.weight, weight)
    assert [t.tolist() for t in decoded.many] == [[1.0, 1.0], [0, 0, 0]]
    assert np.array_equal(decoded.positions, message.positions)


def test_non_contiguous_and_grad_tensors():
    base = torch.randn(6, 4, requires_grad=True)
    message = StepTensors(0, base.t(), base[::2], np.arange(10)[::3])
    decoded = roundtrip(message)
    assert torch.equal(decoded.token_ids, base.t().detach())
    assert torch.equal(decoded.logprobs, base[::2].detach())
    assert decoded.positions.tolist() == [0, 3, 6, 9]


@pytest.mark.parametrize(
    "dtype", [np.int8, np.uint16, np.int32, np.int64, np.float16, np.float32, np.float64, np.bool_]
)
def test_numpy_arrays(dtype):
    array = (np.arange(24).reshape(2, 3, 4) % 5).astype(dtype)
    decoded = roundtrip(StepTensors(0, torch.zeros(1), None, array))
    assert decoded.positions.dtype == array.dtype
    assert np.array_equal(decoded.positions, array)


def test_tensor_frames_are_zero_copy_views():
    tensor = torch.arange(1 << 16, dtype=torch.int64)
    frames = CODEC.encode(StepTensors(0, tensor, None, np.zeros(1)))
    frame = np.frombuffer(frames[1], dtype=np.int64)
    assert frame.ctypes.data == tensor.data_ptr()
    # Decoding from a writable buffer shares it as well.
    decoded = CODEC.decode(frames)
    assert decoded.token_ids.data_ptr() == tensor.data_ptr()


def test_one_frame_per_large_tensor_in_field_order():
    big = torch.arange(INLINE_MAX_BYTES, dtype=torch.int32)
    message = StepTensors(
        0, big, torch.ones(2), np.zeros(INLINE_MAX_BYTES), TensorHolder("w", big * 2), [big * 3]
    )
    frames = CODEC.encode(message)
    assert len(frames) == 5  # envelope + token_ids, positions, nested.weight, many[0]
    assert frames[1].nbytes == big.nbytes
    decoded = CODEC.decode(frames)
    assert torch.equal(decoded.many[0], big * 3)
    assert torch.equal(decoded.nested.weight, big * 2)


def test_decoded_arrays_are_writable_and_never_alias_read_only_input():
    tensor = torch.arange(INLINE_MAX_BYTES, dtype=torch.float32)
    message = StepTensors(0, tensor, torch.ones(3), np.arange(4))
    frames = [bytes(frame) for frame in CODEC.encode(message)]
    decoded = CODEC.decode(frames)
    decoded.token_ids.add_(1)  # must not touch the immutable bytes
    decoded.logprobs.add_(1)
    decoded.positions[:] += 1
    assert torch.equal(decoded.token_ids, tensor + 1)
    again = CODEC.decode(frames)
    assert torch.equal(again.token_ids, tensor)
    assert torch.equal(again.logprobs, torch.ones(3))
    assert again.positions.tolist() == [0, 1, 2, 3]


def test_big_tensor_32_mib():
    tensor = torch.randint(0, 2**15, (8 * 1024 * 1024,), dtype=torch.int32)  # 32 MiB
    frames = CODEC.encode(StepTensors(0, tensor, None, np.zeros(1)))
    assert frames[1].nbytes == 32 * 1024 * 1024
    decoded = CODEC.decode([bytearray(frame) for frame in frames])
    assert torch.equal(decoded.token_ids, tensor)


def test_unknown_tag_raises_clear_error():
    frames = [msgpack.packb(("NoSuchMessage", {}), use_bin_type=True)]
    with pytest.raises(UnknownMessageType, match="NoSuchMessage"):
        CODEC.decode(frames)


def test_unregistered_class_cannot_be_encoded():
    with pytest.raises(UnknownMessageType, match="Other"):
        CODEC.encode(Other("x"))


def test_malformed_frames_raise_codec_error():
    with pytest.raises(CodecError):
        CODEC.decode([])
    with pytest.raises(CodecError):
        CODEC.decode([b"\xc1not msgpack"])
    frames = CODEC.encode(StepTensors(0, torch.zeros(INLINE_MAX_BYTES), None, np.zeros(2)))
    with pytest.raises(CodecError):
        CODEC.decode(frames[:1])  # the tensor's frame is missing


def test_object_arrays_are_refused():
    with pytest.raises(CodecError, match="pickle"):
        CODEC.encode(StepTensors(0, torch.zeros(1), None, np.array([object()])))


def test_duplicate_tag_is_refused():
    DuplicateName = attrs.frozen(type("PerStep", (), {"__annotations__": {"x": int}}))
    with pytest.raises(ValueError, match="PerStep"):
        Codec([PerStep, DuplicateName])


def test_never_uses_pickle(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("pickle used")

    for name in ("dumps", "loads", "dump", "load"):
        monkeypatch.setattr(pickle, name, forbidden)
    monkeypatch.setattr(pickle, "Pickler", forbidden)
    monkeypatch.setattr(pickle, "Unpickler", forbidden)
    codec = Codec([AddRequest, StepTensors])  # building hooks must not pickle either
    message = StepTensors(
        1, torch.randn(3).to(torch.bfloat16), None, np.arange(3), TensorHolder("w", torch.ones(1))
    )
    decoded = codec.decode(codec.encode(message))
    assert same_tensor(decoded.token_ids, message.token_ids)
    assert codec.decode(codec.encode(make_add_request())) == make_add_request()


def test_lifecycle_words_travel_as_their_values_and_come_back_as_enums():
    from trillium.actors.protocol import ALL_MESSAGE_TYPES
    from trillium.actors.protocol.admin import ControlReply, Pause, Sleep, WakeUp
    from trillium.actors.protocol.outputs import SchedulerStats
    from trillium.actors.protocol.vocabulary import EngineState, PauseMode, WakeTag

    codec = Codec(ALL_MESSAGE_TYPES)
    stats = SchedulerStats(1, 0, 0, 0, 0.0, 10, 0, 0, 0, engine_state=EngineState.DRAINING)
    frames = codec.encode(stats)
    _, payload = msgpack.unpackb(frames[0], raw=False)
    assert type(payload["engine_state"]) is str and payload["engine_state"] == "draining"
    assert codec.decode(frames).engine_state is EngineState.DRAINING

    for message, field, expected in [
        (Pause("p", mode=PauseMode.KEEP), "mode", PauseMode.KEEP),
        (Sleep("s", 1, mode=PauseMode.WAIT), "mode", PauseMode.WAIT),
        (WakeUp("w"), "tags", (WakeTag.WEIGHTS, WakeTag.KV_CACHE)),
        # a plain string (what an HTTP body or a test holds) comes back as the member
        (Pause("p", mode="wait"), "mode", PauseMode.WAIT),
        (WakeUp("w", tags=("kv_cache",)), "tags", (WakeTag.KV_CACHE,)),
    ]:
        value = getattr(codec.decode(codec.encode(message)), field)
        values, expected_values = (value, expected) if field == "tags" else ((value,), (expected,))
        assert values == expected_values
        assert [type(v) for v in values] == [type(e) for e in expected_values], "members, not plain strings"

    with pytest.raises(CodecError, match="later"):
        codec.decode(codec.encode(Pause("p", mode="later")))  # a word outside the vocabulary

    # A reply's data (dict[str, Any]) carries the values; JSON and f-strings see them too.
    data = {"state": EngineState.PAUSED, "asleep": [WakeTag.WEIGHTS]}
    assert codec.decode(codec.encode(ControlReply("c", data=data))).data == {"state": "paused", "asleep": ["weights"]}
    assert json.dumps(data) == '{"state": "paused", "asleep": ["weights"]}'
    assert f"{EngineState.UPDATING_WEIGHTS} {PauseMode.ABORT}" == "updating_weights abort"


def test_defaults_stay_off_the_wire_and_come_back():
    """Per-step deltas leave their default fields out of the envelope (smaller, faster);
    decoding restores them, and a field holding an array (however deep) always travels."""
    from trillium.actors.protocol import ALL_MESSAGE_TYPES
    from trillium.actors.protocol.admin import Sleep
    from trillium.actors.protocol.outputs import DetokenizeSpec, RequestDelta, TokenDeltas

    codec = Codec(ALL_MESSAGE_TYPES)
    plain = RequestDelta("r0", (5,))
    first = RequestDelta("r1", (6, 7), num_prompt_tokens=3, spec=DetokenizeSpec(
        np.arange(3, dtype=np.int32), skip_special_tokens=True, stop=("x",), include_stop_str_in_output=False))
    message = TokenDeltas(4, (plain, first))
    frames = codec.encode(message)
    _, payload = msgpack.unpackb(frames[0], raw=False)
    sent = payload["deltas"]
    assert "finish_reason" not in sent[0] and "logprobs" not in sent[0] and "num_prompt_tokens" not in sent[0]
    assert sent[1]["num_prompt_tokens"] == 3 and "min_tokens" not in sent[1]["spec"]
    assert "pooled" in sent[0] and "spec" in sent[0], "array-holding fields travel even at their default"
    decoded = codec.decode(frames)
    assert decoded.deltas[0] == plain and decoded.deltas[0].logprobs == ()
    assert decoded.deltas[1].spec.stop == ("x",) and decoded.deltas[1].spec.prompt_token_ids.tolist() == [0, 1, 2]
    slept = codec.decode(codec.encode(Sleep("s", 1)))  # kv: a KvTransfers of arrays, at its default
    assert (slept.command_id, slept.level, slept.keep_prefix_cache) == ("s", 1, False)
    assert slept.kv.load_block_ids.size == 0
