"""The weight arena (models/weight_arena.py): a CPU model's weights in one 2 MB-aligned block each for
parameters and buffers, values and identities kept, tensors sharing a storage left together, and sleep level 2 still able to
free the parameters' arena and pack the refill again; and `huge_page_zeros`, which the CPU KV caches come from
(aligned, advised, zeroed, freed by sleep and allocated the same way on waking).

The speed it buys is measured, not tested: bench/weight_arena.py.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from support.paged_runner import random_sequences, run_schedule
from trillium.actors.executor.core import ExecutorCore
from trillium.actors.executor.memory import DeviceMemory
from trillium.actors.protocol.vocabulary import WakeTag
from trillium.config import EngineConfig
from trillium.models import load_model, weight_arena
from trillium.models.loader import reload_weights


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def _assert_packed(model: torch.nn.Module) -> None:
    params, buffers = list(model.parameters()), list(model.buffers())
    assert len(_storages(params)) == 1, "every parameter is a view of one arena"
    assert len(_storages(buffers)) == 1, "every buffer is a view of another"
    assert _storages(params) != _storages(buffers), "sleep level 2 frees the parameters' arena alone"
    ptrs = sorted(t.data_ptr() for t in params)
    assert ptrs[0] % weight_arena.HUGE_PAGE_BYTES == 0, "the arena starts on a 2 MB page"
    assert all(p % weight_arena.ALIGN_BYTES == 0 for p in ptrs)
    assert all(t.is_contiguous() for t in [*params, *buffers])
    if weight_arena._thp_mode() in ("always", "madvise"):
        assert "hg" in _vm_flags(ptrs[0]), "the kernel recorded MADV_HUGEPAGE on the arena"


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding `address` (/proc/self/smaps)."""
    flags = weight_arena.smaps_field(address, "VmFlags:")
    assert flags is not None, f"no mapping holds {address:#x}"
    return flags


def _unpack(model: torch.nn.Module) -> None:
    """Each tensor in an allocation of its own again, as the loader left them before the arena."""
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.clone()
        for buffer in model.buffers():
            buffer.set_(buffer.clone())


def test_loaded_weights_sit_in_arenas_with_the_same_values_and_outputs(checkpoint):
    model, _ = load_model(checkpoint("qwen2"), progress=False)  # biases too
    _assert_packed(model)
    pointers = [t.data_ptr() for t in [*model.parameters(), *model.buffers()]]
    assert weight_arena.pack(model) is None, "packed already: nothing moves"
    assert [t.data_ptr() for t in [*model.parameters(), *model.buffers()]] == pointers

    _unpack(model)
    named = dict(model.named_parameters()) | dict(model.named_buffers())
    assert len(_storages(named.values())) == len(named)
    before = {name: t.clone() for name, t in named.items()}
    seqs = random_sequences(model.config.vocab_size, seed=3)
    outputs = run_schedule(model, seqs)
    report = weight_arena.pack(model)
    assert report.num_tensors == len(named)
    assert report.arena_bytes >= sum(t.numel() * t.element_size() for t in named.values())
    assert report.huge_page_bytes <= report.arena_bytes
    _assert_packed(model)
    for name, tensor in (dict(model.named_parameters()) | dict(model.named_buffers())).items():
        assert tensor is named[name], f"{name}: the module keeps the same tensor object"
        assert torch.equal(tensor, before[name]), name
    for x, y in zip(outputs, run_schedule(model, seqs)):
        assert torch.equal(x, y)


def test_tensors_sharing_a_storage_are_left_together():
    class Views(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            base = torch.arange(12.0)
            self.a = torch.nn.Parameter(base[:6], requires_grad=False)
            self.b = torch.nn.Parameter(base[6:], requires_grad=False)
            self.c = torch.nn.Parameter(torch.ones(5), requires_grad=False)

    module = Views()
    shared = module.a.untyped_storage().data_ptr()
    report = weight_arena.pack(module)
    assert report.num_tensors == 1  # c alone
    assert module.a.untyped_storage().data_ptr() == shared == module.b.untyped_storage().data_ptr()
    assert torch.equal(torch.cat([module.a, module.b]), torch.arange(12.0))
    assert module.c.data_ptr() % weight_arena.HUGE_PAGE_BYTES == 0 and torch.equal(module.c, torch.ones(5))
    assert weight_arena.pack(torch.nn.Module()) is None


def test_sleep_level_2_drops_the_arena_and_the_refill_packs_again(checkpoint):
    path = checkpoint("llama")
    config = EngineConfig.build(model=str(path), kv_cache_memory="4MiB", enforce_eager=True).resolve()
    core = ExecutorCore(config)
    _assert_packed(core.model)
    buffers = {name: t.data_ptr() for name, t in core.model.named_buffers()}
    memory = DeviceMemory(core)
    arena = StorageWeakRef(next(core.model.parameters()).untyped_storage())
    slept = memory.sleep(2)
    assert slept["freed_weight_bytes"] > 0
    assert arena.expired(), "nothing holds the parameters' arena after sleep level 2"
    assert {name: t.data_ptr() for name, t in core.model.named_buffers()} == buffers  # buffers untouched

    memory.before_weight_load()
    reload_weights(core.model, path, progress=False)
    memory.weights_loaded(set(core.model.checkpoint_weight_names()))
    assert memory.num_missing_weights == 0
    assert len(_storages(core.model.parameters())) == 1, "the refilled parameters are one arena again"
    memory.wake_up((WakeTag.WEIGHTS, WakeTag.KV_CACHE))
    model, _ = load_model(path, progress=False)
    for (name, x), (_, y) in zip(core.model.state_dict().items(), model.state_dict().items()):
        assert torch.equal(x, y), name


def test_huge_page_zeros_are_zeros_aligned_and_advised():
    """huge_page_zeros: a zeroed tensor of the shape and dtype asked, from 2 MB on in a 2 MB-aligned block
    advised for huge pages; below 2 MB plain torch.zeros (the advice would buy nothing)."""
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        shape = (3 << 20) // dtype.itemsize // 64, 4, 16  # 3 MB: not a whole number of 2 MB pages
        tensor = weight_arena.huge_page_zeros(shape, dtype)
        assert tensor.shape == shape and tensor.dtype == dtype and tensor.is_contiguous()
        assert tensor.data_ptr() % weight_arena.HUGE_PAGE_BYTES == 0
        assert not tensor.float().any()
        if weight_arena._thp_mode() in ("always", "madvise"):
            assert "hg" in _vm_flags(tensor.data_ptr())
            tail = tensor.data_ptr() + weight_arena.HUGE_PAGE_BYTES  # the last, partial 2 MB: not advised
            assert "hg" not in _vm_flags(tail), "only the whole 2 MB pages are advised (no memory added)"
        tensor.fill_(1)  # the whole range is writable
        assert tensor.float().sum().item() == tensor.numel()
        address = tensor.data_ptr()
        del tensor
        assert weight_arena.smaps_field(address, "VmFlags:") is None, "a mapping of its own, unmapped when freed"
    small = weight_arena.huge_page_zeros((16, 16), torch.float32)
    assert small.shape == (16, 16) and not small.any()


def test_cpu_kv_caches_sit_on_2mb_pages_and_sleep_still_frees_them(checkpoint):
    """The executor's KV caches on the CPU (kv_cache.allocate_kv_caches): each a 2 MB-aligned block
    advised for huge pages, zeroed; sleep frees them and waking allocates them the same way again."""
    config = EngineConfig.build(model=str(checkpoint("llama")), kv_cache_memory="64MiB", enforce_eager=True).resolve()
    core = ExecutorCore(config)

    def check(caches) -> list[torch.Tensor]:
        tensors = [t for c in caches for t in (c.k_cache, c.v_cache)]
        assert all(t.numel() * t.element_size() >= weight_arena.HUGE_PAGE_BYTES for t in tensors)  # the premise
        assert all(t.data_ptr() % weight_arena.HUGE_PAGE_BYTES == 0 and not t.any() for t in tensors)
        if weight_arena._thp_mode() in ("always", "madvise"):
            assert all("hg" in _vm_flags(t.data_ptr()) for t in tensors)
        return tensors

    refs = [StorageWeakRef(t.untyped_storage()) for t in check(core.kv_caches)]
    memory = DeviceMemory(core)
    memory.sleep(1)
    assert all(ref.expired() for ref in refs), "sleep frees the KV caches' blocks"
    memory.wake_up((WakeTag.KV_CACHE,))
    check(core.kv_caches)
