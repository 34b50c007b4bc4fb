"""Live weight updates: read, validate every tensor, then copy (all or nothing).

Sources (protocol/admin.py): a checkpoint on disk (HF directory or
GGUF, through `models/loader.py`), the raw bytes of a safetensors file, or
tensors received over a weights update group (`distributed/update_group.py`,
into `shadow_weights.py`'s shadow). Each becomes a list of (HF name, tensor)
held in memory in full, then:

0. For a distributed update, `WeightValidator.check_announced` first: the
   announced names, shapes and total size against the model on meta
   tensors, before a single receive buffer is allocated (a shape such as
   [2**40] is a 400, never an allocation).
1. `WeightValidator.check`: names, shapes and dtypes against the model,
   before anything is copied. It runs the model's own `load_weights` on a
   twin built on the meta device (no storage), so the name resolution and
   shape checks are exactly those of a real load, and a bad name or shape
   raises there, with the real weights untouched (400).
2. `apply`: `model.load_weights` into the live parameters. Validated, it
   cannot fail half way. The scheduler sends no step while this runs, so no
   forward ever sees a mix of old and new weights.

Runs on the executor's torch thread. Floating tensors of another dtype are
cast on copy (a bf16 trainer may update an fp32 engine); integer or bool
tensors are refused.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import torch

from trillium.actors.protocol.admin import ControlError

NamedTensors = list[tuple[str, torch.Tensor]]

# Config fields that must match for a checkpoint to fit the running model:
# the shapes, and what is baked into modules at build time (norm eps). Rope
# is compared by its table: an HF "llama3" and a GGUF "freq_factors" config
# of the same model describe the same rotation.
_STRUCTURE = (
    "architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
    "num_kv_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings", "attention_bias",
    "attention_out_bias", "mlp_bias", "qk_norm", "sliding_window", "layer_types", "moe", "gemma",
)


def read_checkpoint(path: str, model) -> NamedTensors:
    """Every tensor of the checkpoint at `path`, after checking it fits `model`."""
    from trillium.models.loader import open_checkpoint
    from trillium.models.rope import build_cos_sin_cache

    try:
        config, weights, _ = open_checkpoint(path)
    except (OSError, ValueError, KeyError) as exc:
        raise ControlError(400, f"cannot open checkpoint {path!r}: {exc}") from None
    ours = model.config
    mismatched = [f for f in _STRUCTURE if not _same(getattr(config, f), getattr(ours, f))]
    if mismatched:
        details = ", ".join(f"{f}={getattr(config, f)!r} (serving {getattr(ours, f)!r})" for f in mismatched)
        raise ControlError(400, f"{path} holds a different model: {details}")
    try:
        rope = build_cos_sin_cache(config, model.max_positions)
    except (NotImplementedError, KeyError, ValueError) as exc:
        raise ControlError(400, f"{path}: unsupported rope: {exc}") from None
    if not torch.allclose(rope, build_cos_sin_cache(ours, model.max_positions), atol=1e-5):
        raise ControlError(400, f"{path} rotates positions differently (rope {config.rope_scaling!r})")
    try:
        return list(weights)
    except (OSError, ValueError) as exc:
        raise ControlError(400, f"cannot read checkpoint {path!r}: {exc}") from None


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6)  # GGUF keeps float32 metadata
    return a == b


def parse_safetensors(blob: np.ndarray) -> NamedTensors:
    """The tensors of a safetensors file's raw bytes (any subset of names)."""
    from safetensors.torch import load

    try:
        tensors = load(np.ascontiguousarray(blob, dtype=np.uint8).tobytes())
    except Exception as exc:  # safetensors raises its own SafetensorError
        raise ControlError(400, f"not a valid safetensors payload: {exc}") from None
    if not tensors:
        raise ControlError(400, "the safetensors payload holds no tensors")
    return list(tensors.items())


def read_safetensors_file(path: str) -> NamedTensors:
    """The tensors of a safetensors file on disk (an upload the api streamed there)."""
    from safetensors.torch import load_file

    try:
        tensors = load_file(path)
    except Exception as exc:  # safetensors raises its own SafetensorError; OSError for a missing file
        raise ControlError(400, f"not a valid safetensors payload: {exc}") from None
    if not tensors:
        raise ControlError(400, "the safetensors payload holds no tensors")
    return list(tensors.items())


def parse_dtype(name: str) -> torch.dtype:
    """"bfloat16" / "torch.bfloat16" -> torch.bfloat16 (floating dtypes only)."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ControlError(400, f"unsupported weight dtype {name!r}")
    return dtype


class WeightValidator:
    """Checks (name, tensor) pairs against a storage-less twin of the model."""

    def __init__(self, model) -> None:
        with torch.device("meta"):
            self._twin = type(model)(model.config, dtype=model.dtype, max_positions=model.max_positions)
        self.required = frozenset(model.checkpoint_weight_names())
        self._live = model  # NOTE: read for its packed GGUF projections only (models/packed_linear.py)
        # WHY the twin's: its shapes are the model's even while the live weights sleep without storage.
        self.num_elements = sum(p.numel() for p in self._twin.parameters())

    def check_announced(self, names: tuple[str, ...], dtypes: tuple[torch.dtype, ...],
                        shapes: tuple[tuple[int, ...], ...]) -> None:
        """ControlError(400) unless tensors of these names, dtypes and shapes would load; allocates nothing."""
        # WHY twice the model: a checkpoint may carry a tied weight under both names; nothing more.
        limit = 2 * self.num_elements
        total = sum(math.prod(shape) for shape in shapes)  # Python ints: no overflow
        if total > limit:
            raise ControlError(400, f"the update announces {total} elements; the model has {self.num_elements} "
                                    f"(at most {limit} accepted)")
        if any(len(shape) > 8 or min(shape, default=1) < 0 for shape in shapes):
            raise ControlError(400, "shapes: each shape has at most 8 non-negative dimensions")
        try:
            meta = [(name, torch.empty(shape, dtype=dtype, device="meta"))
                    for name, dtype, shape in zip(names, dtypes, shapes)]
        except (RuntimeError, ValueError, OverflowError) as exc:
            raise ControlError(400, f"bad shape: {exc}") from None
        self.check(meta)

    def check(self, named: Iterable[tuple[str, torch.Tensor]], *, complete: bool = False) -> set[str]:
        """The checkpoint names `named` would load; ControlError(400) if any
        tensor does not fit, or (complete=True) if a weight is missing."""
        named = list(named)
        for name, tensor in named:
            if not tensor.dtype.is_floating_point:
                raise ControlError(400, f"{name}: dtype {tensor.dtype} is not a floating dtype")
        _refuse_packed(self._live, named)
        try:
            loaded = self._twin.load_weights(named)
        except KeyError as exc:
            raise ControlError(400, f"unknown weight: {exc.args[0]}") from None
        except (ValueError, RuntimeError) as exc:
            raise ControlError(400, f"bad weight: {exc}") from None
        if complete:
            missing = sorted(self.required - loaded)
            if missing:
                raise ControlError(400, f"checkpoint lacks {len(missing)} weights, e.g. {missing[:4]}")
        return loaded


def _refuse_packed(model, named: NamedTensors) -> None:
    """A float tensor for a projection kept in GGUF blocks or AWQ/GPTQ int4 is a 400 (it has nowhere to go)."""
    from trillium.models.int4_linear import Int4Linear, int4_format_of
    from trillium.models.packed_linear import GgufLinear, packed_format_of

    kinds = {type(m) for m in model.modules()}
    for name, _ in named:
        if GgufLinear in kinds and (fmt := packed_format_of(model, name)) is not None:
            raise ControlError(400, f"{name}: this server keeps that projection packed ({fmt}, GGUF); weight "
                                    "updates need a server started with --gguf-dequantize")
        if Int4Linear in kinds and (fmt := int4_format_of(model, name)) is not None:
            raise ControlError(400, f"{name}: this server keeps that projection at 4 bits ({fmt}); float weight "
                                    "updates need a server started from a float checkpoint")


def apply(model, named: NamedTensors) -> set[str]:
    """Copy validated tensors into the live parameters."""
    return model.load_weights(named)
