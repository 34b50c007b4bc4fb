"""A torch.compile'd function's bytecode per bucket, called directly: no Dynamo guard evaluation per step.

    dispatch = DirectDispatch(fn, model)     fn: the plain function torch.compile wraps (its own code object)
    with dispatch.capture(key):              the bytecode Dynamo makes for this call of the compiled
        compiled(*args)                      function is kept for `key` (a bucket)
    dispatch.get(key) -> function | None     fn running that bytecode (None: none kept, or invalidated)
    dispatch.invalidated -> str | None       why get() answers None from now on (it stops watching the
                                             model when garbage collected)

WHY: at every call Dynamo checks the frame against its guards before it runs the compiled graph.
The decode graph's guards walk the model (each layer's modules, parameters and their metadata, the
KV slots): ~2000 checks, 0.5-1.1 ms a call, 7-15% of a SmolLM2-135M decode step
(torch profiler's "TorchDynamo Cache Lookup"). The bytecode Dynamo generates for a frame loads the
graph's inputs (the parameters included) from the frame and calls the compiled graph; called as a
function, it runs the same graph on the live tensors with no guards. vLLM does the same
(`TorchCompileWrapperWithCustomDispatcher`, vllm/compilation/wrapper.py: a bytecode hook keeps
Dynamo's code, `dispatch_to_code` runs it).

What the guards would have caught, and how this notices instead:
  - a structural change of the model (a submodule, parameter or buffer registered on any of its
    modules: install_packed swapping a Linear for a GgufLinear on a reload of other formats, a
    module replaced): torch.nn's global registration hooks watch the model's modules; any
    registration invalidates the direct path for good, and the caller's guarded compiled function
    takes over (recompiling as Dynamo decides).
  - tensor data swapped in place (sleep / wake, weight updates copying into the parameters): not a
    change here; the bytecode reads the parameters live.
  - a call that is not the bucket's shape: the caller only asks for the bucket it padded to.
Only a single graph per key is taken: if Dynamo compiled more than one frame while capturing (a
graph break), nothing is kept for that key and the guarded path runs it.
"""

from __future__ import annotations

import contextlib
import logging
import types
import weakref
from collections.abc import Iterator

import torch
from torch import nn

log = logging.getLogger(__name__)


class DirectDispatch:
    def __init__(self, fn: types.FunctionType, model: nn.Module) -> None:
        self._fn = fn
        self._functions: dict[int, types.FunctionType] = {}
        self.invalidated: str | None = None
        modules = weakref.WeakSet(model.modules())
        this = weakref.ref(self)

        def on_register(kind: str):
            def hook(module, name, value):
                owner = this()
                if owner is not None and module in modules:
                    owner._invalidate(f"a {kind} {name!r} was registered on {type(module).__name__}")

            return hook

        registrations = nn.modules.module
        handles = [
            registrations.register_module_module_registration_hook(on_register("submodule")),
            registrations.register_module_parameter_registration_hook(on_register("parameter")),
            registrations.register_module_buffer_registration_hook(on_register("buffer")),
        ]
        weakref.finalize(self, _remove, handles)

    @contextlib.contextmanager
    def capture(self, key: int) -> Iterator[None]:
        """Keep the bytecode Dynamo generates for `fn` inside this block as `key`'s."""
        codes: list[types.CodeType] = []
        others: list[str] = []

        def hook(old_code: types.CodeType, new_code: types.CodeType):
            if old_code is self._fn.__code__:
                codes.append(new_code)
            else:  # a resume function after a graph break, or another frame: not one graph
                others.append(old_code.co_name)
            return None

        handle = torch._dynamo.convert_frame.register_bytecode_hook(hook)
        try:
            yield
        finally:
            handle.remove()
        if len(codes) == 1 and not others:
            fn = self._fn
            self._functions[key] = types.FunctionType(codes[0], fn.__globals__, fn.__name__, fn.__defaults__,
                                                      fn.__closure__)
        elif codes or others:
            log.info("compiled decode bucket %d keeps Dynamo's guards (%d graphs, other frames %s)", key,
                     len(codes), others)

    def get(self, key: int) -> types.FunctionType | None:
        return None if self.invalidated else self._functions.get(key)

    def _invalidate(self, why: str) -> None:
        if self.invalidated is None and self._functions:
            log.info("compiled decode: %s; its graphs run through Dynamo's guards from now on", why)
        self.invalidated = self.invalidated or why
        self._functions.clear()


def _remove(handles: list) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


__all__ = ["DirectDispatch"]
