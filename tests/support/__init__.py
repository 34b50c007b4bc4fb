"""Fakes, builders and process harnesses shared by the test folders.

Imported as `support.<module>` (tests/ is on sys.path through pytest's
rootdir conftest), so no test edits `sys.path` to reach a sibling folder,
and no test module imports another test module for its helpers.

Scheduler and KV tiers (pure):
    fake_executor      FakeExecutor / TieredFakeExecutor (simulated KV cache), reference
    scheduler_harness  Harness (scheduler + fake executor), add_req, run_conversations
    pool_requests      FakeRequest, admit, check_invariants for BlockPool
Models and kernels:
    paged_runner       run a model through paged steps; HF logits to compare with
    paged_batches      random paged-KV batches and a dense attention oracle
    oracles            where the real models are; transformers as the oracle
    triton_backend     NVIDIA backend check; the environment of a child script run
LoRA:
    lora_adapters      PEFT adapters on disk, random in-memory adapters, peft_greedy
    lora_batches       the mixed-adapter paged schedule and its driver
    lora_op_cases      operands and segment layouts for the batched LoRA ops
Offline engine:
    llm_parity         mixed prompts and the greedy parity check against transformers
    chat_turns         multi-turn chats for the KV tier tests
Servers and processes:
    serve_process      a real `trillium serve` subprocess (free_port, child_pids)
    admin_server       the same with its admin port, for the control-plane tests
    data_plane_server  an engine and data-plane apps on a background thread
    broadcast_trainer  a trainer process pushing weights by broadcast (run as a script)
    sglang_trainer     a trainer written as SGLang's RL test writes it; no Trillium import (script)
    waiting            wait_until / wait_until_async: bounded polls of real time
"""
