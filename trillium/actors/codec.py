"""The codec: the only place where actor messages become bytes and back.

A message is a frozen attrs class registered with a :class:`Codec`. On the
wire it is a list of frames (one ZeroMQ multipart message)::

    frame 0        msgpack envelope: [tag, payload]
                   tag     = the message class name (the tagged union's key)
                   payload = cattrs-unstructured fields; every tensor or
                             ndarray field is a stub [data, dtype, shape]
    frame 1..n     raw bytes of each large tensor / ndarray, in field order

A stub's data is the frame index of a large buffer, or, for one of at most
``INLINE_MAX_BYTES``, the bytes themselves (see there for why).

Fields may be nested attrs classes, lists, tuples, dicts, Optional, unions of
attrs classes (tagged by class name as well), enums, and int / float / str /
bytes / bool. Fields annotated ``torch.Tensor`` or ``numpy.ndarray`` travel
zero-copy on both sides where the memory allows it: large CPU tensors and
C-contiguous arrays are handed out as memoryviews of their own buffers, and
decoding wraps a received (writable) frame with ``np.frombuffer`` /
``torch.from_numpy``. Decoded arrays and tensors are always writable. CUDA
tensors are copied to the CPU on encode and decode as CPU tensors. Dtypes
that numpy lacks (bfloat16, float8) travel as same-width integers.

NOTE: sending a large CPU tensor or array hands its memory to the message.
ZeroMQ reads the frame after ``send`` returns, and over ``inproc://`` the
receiver's tensor *is* that memory, so the sender must not mutate it after
sending (the same contract as vLLM's msgspec aux buffers).

No pickle anywhere: an unknown tag, an unregistered class or a field type the
converter cannot handle raises :class:`CodecError`.

State owned: one cattrs converter per Codec (hooks generated once, at
construction) and a thread-local slot that lends the frame list to the tensor
hooks during one encode/decode call.
"""

from __future__ import annotations

import sys
import threading
import typing
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Union, get_args, get_origin

import attrs
import msgpack
import numpy as np
from cattrs.gen import make_dict_unstructure_fn, override
from cattrs.preconf.msgpack import make_converter

Frame = bytes | bytearray | memoryview

__all__ = ["INLINE_MAX_BYTES", "Codec", "CodecError", "Frame", "UnknownMessageType"]


class CodecError(Exception):
    """A message could not be encoded or decoded."""


class UnknownMessageType(CodecError):
    """The envelope's tag (or the object's class) is not registered."""


class _FrameSlot(threading.local):
    """Frames of the encode/decode call running on this thread.

    WHY: cattrs hooks take one value and return one value; the tensor hooks
    need somewhere to put (or find) the side frames without per-call closures.
    """

    def __init__(self) -> None:
        self.frames: list[Any] | None = None


class Codec:
    """Encodes registered message classes to frames and decodes them back."""

    def __init__(self, message_types: Iterable[type]) -> None:
        self._slot = _FrameSlot()
        self._converter = _make_converter(self._slot)
        self._encoders: dict[type, tuple[str, Callable[[Any], Any]]] = {}
        self._decoders: dict[str, tuple[type, Callable[[Any, type], Any]]] = {}
        for cls in message_types:
            self._register(cls)

    @property
    def message_types(self) -> tuple[type, ...]:
        return tuple(self._encoders)

    def _register(self, cls: type) -> None:
        if not attrs.has(cls):
            raise TypeError(f"{cls!r} is not an attrs class")
        tag = cls.__name__
        if tag in self._decoders:
            other = self._decoders[tag][0]
            if other is cls:
                return
            raise ValueError(f"two message classes share the tag {tag!r}: {other!r} and {cls!r}")
        # Generating the hooks here fails early on unsupported annotations and
        # keeps introspection out of the per-message path.
        self._encoders[cls] = (tag, self._converter.get_unstructure_hook(cls))
        self._decoders[tag] = (cls, self._converter.get_structure_hook(cls))

    def encode(self, message: object) -> list[bytes | memoryview]:
        """Frame 0 is the msgpack envelope, then one frame per large tensor or array."""
        try:
            tag, unstructure = self._encoders[type(message)]
        except KeyError:
            raise UnknownMessageType(
                f"{type(message).__qualname__} is not registered with this codec"
            ) from None
        frames: list[Any] = [b""]
        self._slot.frames = frames
        try:
            payload = unstructure(message)
            frames[0] = msgpack.packb((tag, payload), use_bin_type=True)
        except CodecError:
            raise
        except Exception as exc:
            raise CodecError(f"cannot encode {tag}: {exc!r}") from exc
        finally:
            self._slot.frames = None
        return frames

    def decode(self, frames: Sequence[Frame]) -> Any:
        """Inverse of :meth:`encode`; buffers of later frames may be shared."""
        if not frames:
            raise CodecError("no frames to decode")
        try:
            tag, payload = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
        except Exception as exc:
            raise CodecError(f"malformed envelope: {exc!r}") from exc
        try:
            cls, structure = self._decoders[tag]
        except (KeyError, TypeError):
            known = ", ".join(sorted(self._decoders))
            raise UnknownMessageType(f"unknown message tag {tag!r}; known: {known}") from None
        self._slot.frames = frames  # type: ignore[assignment]
        try:
            return structure(payload, cls)
        except CodecError:
            raise
        except Exception as exc:
            raise CodecError(f"cannot decode {tag}: {exc!r}") from exc
        finally:
            self._slot.frames = None


# --- converter --------------------------------------------------------------


def _make_converter(slot: _FrameSlot):
    # detailed_validation=False: messages come from our own processes, and the
    # per-field error bookkeeping roughly doubles structuring time.
    converter = make_converter(detailed_validation=False)
    converter.register_unstructure_hook_factory(_is_tensor_type, lambda _: _tensor_encoder(slot))
    converter.register_structure_hook_factory(_is_tensor_type, lambda _: _tensor_decoder(slot))
    converter.register_unstructure_hook(np.ndarray, _ndarray_encoder(slot))
    converter.register_structure_hook(np.ndarray, _ndarray_decoder(slot))
    # WHY: per-step messages are mostly lists of ints; msgpack already returns
    # fresh lists of the right primitive type, so cattrs' per-element int()
    # calls (about 10 us per 64-entry list) buy nothing.
    converter.register_unstructure_hook_factory(_is_primitive_sequence, lambda _: _identity)
    converter.register_structure_hook_factory(_is_primitive_sequence, _primitive_sequence_decoder)
    # WHY: a per-step delta leaves most of its dozen fields at their defaults;
    # leaving them out halves the envelope and its encode / decode time (a 64-delta
    # TokenDeltas: 13 -> 6 KB). Decoding fills them back in.
    converter.register_unstructure_hook_factory(attrs.has, lambda cls: _omitting_encoder(converter, cls))
    # WHY: the per-step messages hold a tuple of deltas, and each delta tuples of
    # logprobs that are nearly always empty; cattrs' generic tuple hooks cost a
    # generator per tuple, empty or not (~25% of decoding a 64-delta TokenDeltas).
    converter.register_unstructure_hook_factory(_is_class_sequence, lambda t: _class_sequence_encoder(converter, t))
    converter.register_structure_hook_factory(_is_class_sequence, lambda t: _class_sequence_decoder(converter, t))
    converter.register_unstructure_hook_factory(
        _is_union_of_classes, lambda t: _tagged_union_encoder(converter, t)
    )
    converter.register_structure_hook_factory(
        _is_union_of_classes, lambda t: _tagged_union_decoder(converter, t)
    )
    return converter


def _is_tensor_type(t: Any) -> bool:
    # WHY: look torch up in sys.modules instead of importing it, so processes
    # whose messages carry no tensors (api, detokenizer) never load torch.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(t, type) and issubclass(t, torch.Tensor)


_PRIMITIVES = (int, float, str, bytes, bool)


def _is_primitive_sequence(t: Any) -> bool:
    """list[int], tuple[int, ...] and the like, for msgpack-native elements."""
    args = get_args(t)
    if get_origin(t) is list:
        return len(args) == 1 and args[0] in _PRIMITIVES
    if get_origin(t) is tuple:
        return len(args) == 2 and args[1] is Ellipsis and args[0] in _PRIMITIVES
    return False


def _identity(value: Any) -> Any:
    return value


def _primitive_sequence_decoder(t: Any) -> Callable[[Any, Any], Any]:
    if get_origin(t) is tuple:
        return lambda value, _: tuple(value)
    return lambda value, _: value


def _omitting_encoder(converter, cls: type) -> Callable[[Any], Any]:
    """cattrs' dict hook for `cls`, omitting fields equal to their default, except
    fields that hold an array or tensor, however deep (`==` on one is elementwise,
    so such a field always travels)."""
    hints = typing.get_type_hints(cls)
    keep = {f.name: override(omit_if_default=False) for f in attrs.fields(cls) if _holds_array(hints[f.name])}
    return make_dict_unstructure_fn(cls, converter, _cattrs_omit_if_default=True, **keep)


def _holds_array(t: Any, seen: frozenset = frozenset()) -> bool:
    """An array or tensor in `t`: itself, a type argument, or a field of an attrs class."""
    if t is np.ndarray or _is_tensor_type(t) or (isinstance(t, type) and t.__name__ == "Tensor"):
        return True
    if isinstance(t, type) and attrs.has(t):
        if t in seen:
            return False
        hints = typing.get_type_hints(t)
        return any(_holds_array(hints[f.name], seen | {t}) for f in attrs.fields(t))
    return any(_holds_array(a, seen) for a in get_args(t))


def _is_class_sequence(t: Any) -> bool:
    """tuple[A, ...] or list[A] of one attrs class A."""
    args = get_args(t)
    if get_origin(t) is tuple:
        return len(args) == 2 and args[1] is Ellipsis and attrs.has(args[0])
    return get_origin(t) is list and len(args) == 1 and attrs.has(args[0])


def _class_sequence_encoder(converter, t: Any) -> Callable[[Any], Any]:
    hook = converter.get_unstructure_hook(get_args(t)[0])
    return lambda value: [hook(item) for item in value] if value else []


def _class_sequence_decoder(converter, t: Any) -> Callable[[Any, Any], Any]:
    cls = get_args(t)[0]
    hook = converter.get_structure_hook(cls)
    if get_origin(t) is tuple:
        return lambda value, _: tuple([hook(item, cls) for item in value]) if value else ()
    return lambda value, _: [hook(item, cls) for item in value]


def _is_union_of_classes(t: Any) -> bool:
    """A Union with at least two attrs classes (Optional[A] is left to cattrs)."""
    if get_origin(t) not in (Union, _UnionType):
        return False
    members = [a for a in get_args(t) if a is not type(None)]
    return len(members) >= 2 and all(attrs.has(a) for a in members)


_UnionType = type(int | None)


def _tagged_union_encoder(converter, union: Any) -> Callable[[Any], Any]:
    members = [a for a in get_args(union) if a is not type(None)]
    by_class = {cls: (cls.__name__, converter.get_unstructure_hook(cls)) for cls in members}

    def encode(value: Any) -> Any:
        if value is None:
            return None
        tag, hook = by_class[type(value)]
        return (tag, hook(value))

    return encode


def _tagged_union_decoder(converter, union: Any) -> Callable[[Any, Any], Any]:
    members = [a for a in get_args(union) if a is not type(None)]
    by_tag = {cls.__name__: (cls, converter.get_structure_hook(cls)) for cls in members}

    def decode(value: Any, _: Any) -> Any:
        if value is None:
            return None
        tag, payload = value
        if tag not in by_tag:
            raise UnknownMessageType(f"unknown tag {tag!r} for {union!r}")
        cls, hook = by_tag[tag]
        return hook(payload, cls)

    return decode


# --- tensors and arrays ------------------------------------------------------


# Arrays up to this size ride inside the envelope as msgpack bin. WHY: a
# per-step message carries several arrays of a few hundred bytes, and each
# extra ZeroMQ frame costs more (a pyzmq Frame per part on both sides, about
# 10 us per array per hop measured) than copying such a small buffer.
INLINE_MAX_BYTES = 16 * 1024


def _ndarray_encoder(slot: _FrameSlot) -> Callable[[np.ndarray], Any]:
    def encode(array: np.ndarray) -> Any:
        if array.dtype.hasobject or array.dtype.names is not None:
            raise CodecError(f"ndarray dtype {array.dtype} cannot travel without pickle")
        return _array_stub(slot, array, array.dtype.str)

    return encode


def _ndarray_decoder(slot: _FrameSlot) -> Callable[[Any, Any], np.ndarray]:
    dtypes: dict[str, np.dtype] = {}

    def decode(stub: Any, _: Any) -> np.ndarray:
        dtype = dtypes.get(stub[1])
        if dtype is None:
            dtype = dtypes[stub[1]] = np.dtype(stub[1])
        return _array_from_stub(slot, stub, dtype)

    return decode


def _array_stub(slot: _FrameSlot, array: np.ndarray, dtype_name: str) -> tuple[Any, str, Any]:
    """[bytes or frame index, dtype, shape]; large buffers become frames, uncopied."""
    if not array.flags.c_contiguous:
        array = array.copy(order="C")  # (np.ascontiguousarray makes 0-d arrays 1-d)
    if array.nbytes <= INLINE_MAX_BYTES:
        return (array.tobytes(), dtype_name, array.shape)
    frames = slot.frames
    if frames is None:
        raise CodecError("tensors can only be unstructured through Codec.encode")
    frames.append(memoryview(array.reshape(-1).view(np.uint8)))
    return (len(frames) - 1, dtype_name, array.shape)


def _array_from_stub(slot: _FrameSlot, stub: Any, dtype: np.dtype) -> np.ndarray:
    """INVARIANT: the result is writable, like any array its receiver made itself.

    It shares the received frame when that is writable and aligned (large
    frames off ZeroMQ); otherwise (inline bytes, read-only input) it is a copy.
    """
    data, _, shape = stub
    if type(data) is int:
        buffer: Any = memoryview(slot.frames[data])
        if buffer.readonly:
            buffer = bytearray(buffer)
    else:
        buffer = bytearray(data)
    array = np.frombuffer(buffer, dtype=dtype)
    if len(shape) != 1:  # frombuffer is already 1-D; reshape costs ~1 us
        array = array.reshape(shape)
    if not array.flags.aligned:
        array = array.copy()
    return array


def _tensor_encoder(slot: _FrameSlot) -> Callable[[Any], Any]:
    import torch

    wire = _TorchWireTypes.get(torch)

    def encode(tensor: torch.Tensor) -> Any:
        entry = wire.by_dtype.get(tensor.dtype)
        if entry is None:
            raise CodecError(f"tensor dtype {tensor.dtype} cannot travel")
        name, carrier = entry
        if carrier is not None:
            tensor = tensor.view(carrier)  # same width: valid for any strides
        # force=True detaches, copies to the CPU and resolves conj/neg bits,
        # sharing memory whenever those are no-ops.
        return _array_stub(slot, tensor.numpy(force=True), name)

    return encode


def _tensor_decoder(slot: _FrameSlot) -> Callable[[Any, Any], Any]:
    import torch

    wire = _TorchWireTypes.get(torch)

    def decode(stub: Any, _: Any) -> torch.Tensor:
        dtype, np_dtype, carrier = wire.by_name[stub[1]]
        tensor = torch.from_numpy(_array_from_stub(slot, stub, np_dtype))
        return tensor.view(dtype) if carrier is not None else tensor

    return decode


# Tensor dtypes that can travel: numpy-native ones as themselves, the rest
# (no numpy equivalent) reinterpreted as a same-width integer "carrier".
_NUMPY_NATIVE_DTYPES = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
)  # fmt: skip
_CARRIED_DTYPES = {
    "bfloat16": "int16",
    "float8_e4m3fn": "uint8",
    "float8_e5m2": "uint8",
    "float8_e4m3fnuz": "uint8",
    "float8_e5m2fnuz": "uint8",
    "float8_e8m0fnu": "uint8",
}


class _TorchWireTypes:
    """Dtype tables for tensors, built once per process when torch is first seen.

    by_dtype: torch dtype -> (wire name, carrier dtype or None)
    by_name:  wire name -> (torch dtype, numpy dtype of the frame, carrier)
    """

    _instance: _TorchWireTypes | None = None

    def __init__(self, torch: Any) -> None:
        self.by_dtype: dict[Any, tuple[str, Any]] = {}
        self.by_name: dict[str, tuple[Any, np.dtype, Any]] = {}
        pairs = [(name, None) for name in _NUMPY_NATIVE_DTYPES] + list(_CARRIED_DTYPES.items())
        for name, carrier_name in pairs:
            dtype = getattr(torch, name, None)  # older torch lacks some float8s
            if dtype is None:
                continue
            carrier = getattr(torch, carrier_name) if carrier_name else None
            np_dtype = np.dtype(str(carrier or dtype).removeprefix("torch."))
            self.by_dtype[dtype] = (name, carrier)
            self.by_name[name] = (dtype, np_dtype, carrier)

    @classmethod
    def get(cls, torch: Any) -> _TorchWireTypes:
        if cls._instance is None:
            cls._instance = cls(torch)
        return cls._instance
