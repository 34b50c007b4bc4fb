"""Multi-LoRA through the whole engine (offline `LLM`): scheduler slots, executor swaps, parity.

Three PEFT adapters (built by support.lora_adapters.make_peft_adapter) and the
base model, requests mixed in one `generate` call with two device slots, so
the scheduler holds back requests whose adapter has no slot and the
executor swaps adapters in and out. Every request's greedy tokens must equal
transformers + peft with its adapter (the plain model for base requests).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from support.lora_adapters import ADAPTERS, make_peft_adapter, peft_greedy
from trillium import LLM, LoRARequest, SamplingParams

pytest.importorskip("peft")

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def base(checkpoint):
    return checkpoint("llama")


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine-adapters")
    return {name: make_peft_adapter(base, root / name, 10 + seed, **kw)
            for seed, (name, kw) in enumerate(ADAPTERS.items())}


def test_mixed_adapters_with_fewer_slots_than_adapters_match_peft(base, adapters):
    rng = random.Random(3)
    names = [None, "attn", "mlp", "all"] * 3
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(4, 30))] for _ in names]
    # min_tokens masks EOS as hf_greedy (min_new_tokens) does.
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    loras = [None if n is None else LoRARequest(n, str(adapters[n])) for n in names]
    with LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2,
             kv_cache_memory="4MiB") as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora=loras)
        # Twice: the second round finds adapters resident, or swaps them back in.
        again = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora=loras)
    got = [o.outputs[0].token_ids for o in outputs]
    assert [o.outputs[0].token_ids for o in again] == got
    for name in (None, "attn", "mlp", "all"):
        indices = [i for i, n in enumerate(names) if n == name]
        chosen = [prompts[i] for i in indices]
        expected = peft_greedy(base, None if name is None else adapters[name], chosen, MAX_TOKENS)
        assert [got[i] for i in indices] == expected, name
        if name is not None:  # the adapter changes the outputs: this checks something
            assert expected != peft_greedy(base, None, chosen, MAX_TOKENS), name


def test_multi_step_decode_with_adapters_matches_peft(base, adapters):
    """--num-scheduler-steps 4: each request's extra forwards run its own adapter (the executor's
    `_run_ahead` batches them per step as the first forward does)."""
    names = [None, "attn", "mlp", "attn"]
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(4, 30))] for _ in names]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS + 5, min_tokens=MAX_TOKENS + 5)
    loras = [None if n is None else LoRARequest(n, str(adapters[n])) for n in names]
    with LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=16, num_scheduler_steps=4) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                            lora=loras)]
    for name in (None, "attn", "mlp"):
        indices = [i for i, n in enumerate(names) if n == name]
        expected = peft_greedy(base, None if name is None else adapters[name], [prompts[i] for i in indices],
                               MAX_TOKENS + 5)
        assert [got[i] for i in indices] == expected, name


def test_bad_adapters_and_lora_without_enable_lora_are_value_errors(base, adapters, tmp_path):
    params = SamplingParams(temperature=0, max_tokens=2)
    with LLM(str(base), enable_lora=True, max_loras=1, max_lora_rank=8, kv_cache_memory="2MiB") as llm:
        with pytest.raises(ValueError, match="rank"):
            llm.generate([[5, 6, 7]], params, lora=LoRARequest("big", str(adapters["all"])))  # r=16 > 8
        with pytest.raises(ValueError):
            llm.generate([[5, 6, 7]], params, lora=LoRARequest("nowhere", str(tmp_path / "missing")))
        out = llm.generate([[5, 6, 7]], params, lora=LoRARequest("attn", str(adapters["attn"])))
        assert len(out[0].outputs[0].token_ids) == 2, "the engine still serves after refused adapters"
        with pytest.raises(ValueError, match="already loaded"):
            llm.generate([[5, 6, 7]], params, lora=LoRARequest("attn", str(adapters["mlp"])))
    with LLM(str(base), kv_cache_memory="2MiB") as llm:
        with pytest.raises(ValueError, match="enable_lora"):
            llm.generate([[5, 6, 7]], params, lora=LoRARequest("attn", str(adapters["attn"])))
