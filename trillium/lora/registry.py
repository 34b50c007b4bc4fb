"""LoRARegistry: the api process's served adapters, by name (torch-free).

Shared by the control plane (which loads and unloads adapters) and the data
plane (which maps a request's `model` to its adapter and lists adapters in
/v1/models), the way `EngineStatus` is shared: both planes get the same
object from `trillium serve`, neither imports the other.

An adapter is `reserved` while the engine loads it (its name is taken, it is
not served yet), `added` once the engine has it, and `unloading` from the
moment an unload starts: new requests for it get 404 from then on.

A replacement (vLLM's load_inplace) loads the new adapter under a fresh
engine id while the old one stays served (`reserve_replacement`), then
`replaced` points the name at it: requests admitted from then on use the new
adapter; those in flight finish on the old id (their KV and prefix-cache
entries are keyed by it), which the caller unloads once they are done.
"""

from __future__ import annotations

import itertools

import attrs


@attrs.frozen
class LoRAModule:
    name: str
    lora_id: int  # the engine's id (AddRequest.lora_id), >= 1
    path: str


class LoRARegistry:
    def __init__(self) -> None:
        self._modules: dict[str, LoRAModule] = {}
        self._pending: set[str] = set()  # reserved (loading) or unloading
        self._replacing: dict[str, LoRAModule] = {}  # name -> its replacement, loading
        self._ids = itertools.count(1)
        self.num_loads = 0
        self.num_unloads = 0

    def get(self, name: str) -> LoRAModule | None:
        """The served adapter called `name` (None while it loads or unloads)."""
        return None if name in self._pending else self._modules.get(name)

    def served(self) -> list[LoRAModule]:
        return [m for name, m in self._modules.items() if name not in self._pending]

    def reserve(self, name: str, path: str) -> LoRAModule:
        """Take `name` for a load; KeyError if it is taken."""
        if name in self._modules:
            raise KeyError(name)
        module = LoRAModule(name, next(self._ids), path)
        self._modules[name] = module
        self._pending.add(name)
        return module

    def is_replacing(self, name: str) -> bool:
        return name in self._replacing

    def reserve_replacement(self, name: str, path: str) -> LoRAModule:
        """A new engine id for served adapter `name`; KeyError if it is not served,
        ValueError if a replacement is already loading."""
        if self.get(name) is None:
            raise KeyError(name)
        if name in self._replacing:
            raise ValueError(name)
        module = LoRAModule(name, next(self._ids), path)
        self._replacing[name] = module
        return module

    def replaced(self, name: str) -> LoRAModule:
        """Serve the replacement under `name` from now on; the module it replaced."""
        old, self._modules[name] = self._modules[name], self._replacing.pop(name)
        self.num_loads += 1
        return old

    def drop_replacement(self, name: str) -> None:
        """A replacement that failed to load: the old adapter stays."""
        self._replacing.pop(name, None)

    def added(self, name: str) -> None:
        self._pending.discard(name)
        self.num_loads += 1

    def name_of(self, lora_id: int) -> str:
        return next((m.name for m in self._modules.values() if m.lora_id == lora_id), str(lora_id))

    def begin_unload(self, name: str) -> LoRAModule:
        """Stop serving `name` (KeyError if it is not served)."""
        module = self.get(name)
        if module is None:
            raise KeyError(name)
        self._pending.add(name)
        return module

    def remove(self, name: str) -> None:
        """Forget `name` (a load that failed)."""
        self._modules.pop(name, None)
        self._pending.discard(name)

    def unloaded(self, name: str) -> None:
        self.remove(name)
        self.num_unloads += 1

    def restore(self, name: str) -> None:
        """An unload that failed: serve `name` again."""
        self._pending.discard(name)
