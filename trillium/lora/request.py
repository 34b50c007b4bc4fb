"""LoRARequest: which adapter an offline request uses (vLLM's name and fields)."""

from __future__ import annotations

import attrs


@attrs.frozen
class LoRARequest:
    """An adapter by name and PEFT directory. The first request that names it
    loads it (`LLM.generate(..., lora=LoRARequest("sql", "/adapters/sql"))`);
    later ones reuse it. `lora_int_id` is optional: the engine numbers adapters."""

    lora_name: str
    lora_path: str
    lora_int_id: int = 0
