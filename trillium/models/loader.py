"""Load a model from an HF directory (safetensors) or a GGUF file.

    load_model(path, dtype=None, device="cpu") -> (model, ModelConfig)

`path` is either
- an HF directory: config.json + *.safetensors (one file, or shards listed
  in model.safetensors.index.json), or
- a `.gguf` file (or a directory holding exactly one, and no config.json).

Weights stream tensor by tensor into a model built without initialization
(`.empty` of the architecture's class, `registry.py`), through
`model.load_weights`, which also fuses q/k/v, gate/up and stacks experts. Only safetensors and GGUF are read: never pickle, so a
`pytorch_model.bin`-only directory is refused.

GGUF Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 (and K-quant) weights stay packed (`packed_linear.py`: the
projections multiply the blocks) when the model runs float32 on the CPU
and the packed kernel built; `gguf_dequantize=True` (`--gguf-dequantize`)
or any other dtype/device dequantizes every weight to float, as before.
The log says which weights were kept packed and which were dequantized.
`gguf_activations` ("int8", the default, or "float32"; `--gguf-activations`)
is how the packed kernel multiplies decode-sized batches (packed_linear.py).

AWQ and GPTQ 4-bit checkpoints (config.json `quantization_config`,
int4_checkpoint.py) keep their projections at 4 bits the same way
(int4_linear.py: the int4 kernel reads the packed nibbles) when the model
runs float32 on the CPU and the kernel built; otherwise they are
dequantized into the float parameters, and the log says why.

Tensor parallel (`tp=` a group of N > 1 ranks): the model is this rank's
shard (`tensor_parallel.py`) and each safetensors tensor is read through
`get_slice`, so a rank reads only its rows or columns; a GGUF tensor is cut
from the file's blocks before decoding (`gguf_tensor_parallel.py`), packed
projections keeping the rank's blocks.

On the CPU the loaded weights end in one arena advised for 2 MB pages
(`weight_arena.py`), the order a forward reads them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator

import attrs
import torch
from safetensors import safe_open
from tqdm import tqdm

from trillium.kernels import gguf_cpu, int4_cpu
from trillium.models import gguf_checkpoint, weight_arena
from trillium.models.int4_checkpoint import QUANT_SUFFIXES, QuantSpec, quant_spec_of
from trillium.models.checkpoint_files import find_gguf_file, safetensors_files
from trillium.models.config import ModelConfig, dtype_name
from trillium.models.llama import LlamaForCausalLM
from trillium.models.registry import model_class

log = logging.getLogger(__name__)


def _iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _iter_safetensors_shards(files: list[Path], shard) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensor parallel: each tensor's slice for this rank (`TpShard.read`); only its bytes are read."""
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, shard.read(name, f.get_slice(name))


def _iter_gguf_shards(gguf_path: Path, config: ModelConfig, shard, packed_types, dequantized):
    """Tensor parallel: each GGUF tensor's rows / blocks for this rank (gguf_tensor_parallel.py)."""
    reader = gguf_checkpoint.open_gguf(gguf_path)
    return gguf_checkpoint.iter_weights(reader, config, packed_types, dequantized, shard=shard)


def _count_safetensors(files: list[Path]) -> int:
    total = 0
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            total += len(list(f.keys()))
    return total


def _fill(
    model: LlamaForCausalLM,
    weights: Iterator[tuple[str, torch.Tensor]],
    total: int,
    progress: bool,
    source: Path,
    dequantized: dict[str, str] | None = None,
    int4: tuple[QuantSpec, bool] | None = None,
    sliced: bool = False,
) -> None:
    """`int4`: (the AWQ/GPTQ spec, keep packed) for a quantized safetensors checkpoint;
    `sliced`: the tensors are this tensor-parallel rank's slices."""
    from trillium.models.packed_linear import install_packed

    loaded: set[str] = set()
    packed: dict[str, gguf_checkpoint.PackedTensor] = {}
    quantized: dict[str, dict[str, torch.Tensor]] = {}  # HF module -> {"qweight": ..., "scales": ...}
    bar = tqdm(weights, total=total, desc="Loading weights", unit="tensor", disable=not progress)
    for name, tensor in bar:
        if isinstance(tensor, gguf_checkpoint.PackedTensor):
            packed[name] = tensor  # after the floats: a packed projection takes over its (loaded) bias
            continue
        if int4 is not None and name.endswith(QUANT_SUFFIXES):
            module, _, kind = name.rpartition(".")
            quantized.setdefault(module, {})[kind] = tensor  # after the floats too, for the same reason
            continue
        loaded |= model.load_weights([(name, tensor)], **({"sliced": True} if sliced else {}))
    if quantized:
        from trillium.models.int4_linear import install_int4

        loaded |= install_int4(model, int4[0], quantized, int4[1])
    if packed:
        used, report = install_packed(model, packed, sliced)
        report.dequantized.update(dequantized or {})
        loaded |= used
        log.info("%s: %s", source.name, report.summary())
    missing = [n for n in model.checkpoint_weight_names() if n not in loaded]
    if missing:
        raise ValueError(f"{source}: checkpoint lacks {len(missing)} weights, e.g. {missing[:4]}")


def open_checkpoint(
    path: str | Path, packed_types: frozenset[int] = frozenset(), dequantized: dict[str, str] | None = None
) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]], int]:
    """(config, lazy iterator of (HF name, tensor), number of tensors) for a checkpoint path.

    `packed_types`: GGUF types yielded as `PackedTensor` blocks instead of floats
    (`dequantized` then collects the quantized weights that were not, and why).
    """
    gguf_path = find_gguf_file(path)
    if gguf_path is not None:
        reader = gguf_checkpoint.open_gguf(gguf_path)
        config = gguf_checkpoint.read_config(reader)
        weights = gguf_checkpoint.iter_weights(reader, config, packed_types, dequantized)
        return config, weights, gguf_checkpoint.num_weight_tensors(reader)
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is neither an HF model directory nor a .gguf file")
    config = ModelConfig.from_hf_dir(path)
    files = safetensors_files(path)
    return config, _iter_safetensors(files), _count_safetensors(files)


def load_model(
    path: str | Path,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    *,
    max_positions: int | None = None,
    progress: bool = True,
    runner: str = "generate",
    gguf_dequantize: bool = False,
    gguf_activations: str = gguf_cpu.INT8,
    tp=None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model for `path` and load its weights on `device`.

    dtype defaults to the checkpoint's (config.json `dtype`/`torch_dtype`;
    float32 for GGUF, whose weights are dequantized); "auto" means the same.
    The returned config carries the dtype actually used. `max_positions`
    sizes the rope table (default: the config's context, scaled for
    linear/dynamic rope). `runner` "pooling": the pooling class (registry.py).
    `gguf_dequantize`: dequantize every GGUF weight (no packed projections).
    `gguf_activations`: the packed projections' activations for small batches, gguf_cpu.INT8 (int8
    blocks, integer dots: llama.cpp's numerics) or FLOAT32 (exact dequantize-then-matmul).
    `tp`: a `TpGroup` of more than one rank: build this rank's shard of the
    model (`tensor_parallel.py`) and read only its slices of each tensor
    (safetensors `get_slice`; GGUF rows / whole blocks: gguf_tensor_parallel.py).
    """
    gguf_cpu.check_activations(gguf_activations)
    wanted = dtype_name(dtype) if dtype is not None and dtype != "auto" else "float32"  # GGUF's own: float32
    packed_types = _packed_types(path, wanted, torch.device(device), gguf_dequantize)
    dequantized: dict[str, str] = {}
    config, weights, total = open_checkpoint(path, packed_types, dequantized)
    if dtype is not None and dtype != "auto":
        config = attrs.evolve(config, dtype=dtype_name(dtype))
    cls = model_class(config.architecture, runner)
    if tp is not None and tp.size > 1:
        from trillium.models.tensor_parallel import TpShard

        shard = TpShard(tp, config)
        model = cls.empty(config, dtype=config.dtype, device=device, max_positions=max_positions, tp=shard)
        model.gguf_activations = gguf_activations
        gguf_path = find_gguf_file(path)
        if gguf_path is None:
            weights = _iter_safetensors_shards(safetensors_files(path), shard)
        else:
            weights = _iter_gguf_shards(gguf_path, config, shard, packed_types, dequantized)
        _fill(model, weights, total, progress, Path(path), dequantized, sliced=True)
        model.eval()
        _into_arena(model, device)
        return model, config
    model = cls.empty(config, dtype=config.dtype, device=device, max_positions=max_positions)
    model.gguf_activations = gguf_activations
    _fill(model, weights, total, progress, Path(path), dequantized, _int4_plan(path, config.dtype, device))
    model.eval()
    _into_arena(model, device)
    return model, config


def _into_arena(model: torch.nn.Module, device: torch.device | str) -> None:
    """On the CPU, the weights in one huge-page-advised arena (weight_arena.py: a decode step's
    linears stream them 5-7% faster); elsewhere they stay as loaded."""
    if torch.device(device).type == "cpu":
        weight_arena.pack(model)


def _packed_types(path: str | Path, dtype: str, device: torch.device, dequantize: bool) -> frozenset[int]:
    """The GGUF types to keep packed for this load (none: every weight dequantized, with the reason logged)."""
    if find_gguf_file(path) is None:
        return frozenset()
    why = None
    if dequantize:
        why = "--gguf-dequantize"
    elif device.type != "cpu" or dtype != "float32":
        why = f"packed kernels run float32 on the CPU, not {dtype} on {device}"
    elif not gguf_cpu.available():
        why = f"no packed kernel: {gguf_cpu.unavailable_reason()}"
    if why is not None:
        log.info("GGUF weights dequantized to %s (%s)", dtype, why)
        return frozenset()
    return frozenset(gguf_cpu.BLOCK_BYTES)


def _int4_plan(path: str | Path, dtype: str, device: torch.device | str) -> tuple[QuantSpec, bool] | None:
    """(spec, keep packed) for an AWQ/GPTQ checkpoint, None for any other; the reason is logged if not packed."""
    spec = None if find_gguf_file(path) is not None else quant_spec_of(path)
    if spec is None:
        return None
    why = None
    if torch.device(device).type != "cpu" or dtype != "float32":
        why = f"the int4 kernel runs float32 on the CPU, not {dtype} on {device}"
    elif not int4_cpu.available():
        why = f"no int4 kernel: {int4_cpu.unavailable_reason()}"
    if why is not None:
        log.info("%s weights dequantized to %s (%s)", spec.method.upper(), dtype, why)
    return spec, why is None


def reload_weights(model: LlamaForCausalLM, path: str | Path, *, progress: bool = True) -> None:
    """Overwrite `model`'s weights in place from another checkpoint of the same shape.

    For `update_weights_from_disk` and waking from sleep level 2. NOTE: not
    atomic: callers must not run forward passes while this runs.
    """
    from trillium.models.int4_linear import Int4Linear
    from trillium.models.packed_linear import GgufLinear

    is_packed = any(isinstance(m, GgufLinear) for m in model.modules())
    spec = None if find_gguf_file(path) is not None else quant_spec_of(path)
    int4 = None if spec is None else (spec, any(isinstance(m, Int4Linear) for m in model.modules()))
    packed_types = frozenset(gguf_cpu.BLOCK_BYTES) if is_packed else frozenset()
    config, weights, total = open_checkpoint(path, packed_types)
    ours = model.config
    if (config.architecture, config.num_layers, config.hidden_size) != (
        ours.architecture,
        ours.num_layers,
        ours.hidden_size,
    ):
        raise ValueError(f"{path} holds a different model ({config.architecture}, {config.num_layers} layers)")
    gguf_path = find_gguf_file(path)
    shard = getattr(model, "tp", None)
    if gguf_path is not None and shard is not None and shard.size > 1:  # this rank's slices, packed ones too
        weights = _iter_gguf_shards(gguf_path, config, shard, packed_types, None)
        _fill(model, weights, total, progress, Path(path), sliced=True)
        return
    _fill(model, weights, total, progress, Path(path), int4=int4)


def load_model_config(path: str | Path) -> ModelConfig:
    """The checkpoint's ModelConfig without reading any weights."""
    gguf_path = find_gguf_file(path)
    if gguf_path is not None:
        return gguf_checkpoint.read_config(gguf_checkpoint.open_gguf(gguf_path))
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is neither an HF model directory nor a .gguf file")
    return ModelConfig.from_hf_dir(path)
