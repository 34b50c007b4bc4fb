"""The scheduler core's configuration (built from an EngineConfig by
`core.build_scheduler`): batch limits, chunked prefill, prefix caching, the
waiting-queue policy, LoRA slots and the preemption mode. Frozen; checked
when built."""

from __future__ import annotations

import attrs

from trillium.actors.scheduler.preemption import PREEMPTION_MODES


def _positive(instance, attribute, value) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be >= 1, got {value}")


@attrs.frozen
class SchedulerConfig:
    num_blocks: int = attrs.field(validator=_positive)
    block_size: int = attrs.field(default=16, validator=_positive)
    max_num_seqs: int = attrs.field(default=256, validator=_positive)
    max_num_batched_tokens: int = attrs.field(default=8192, validator=_positive)
    max_model_len: int = attrs.field(default=4096, validator=_positive)
    enable_prefix_caching: bool = True
    policy: str = attrs.field(default="fcfs", validator=attrs.validators.in_(("fcfs", "priority")))
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0 = off; else cap a prefill's tokens per step
    max_loras: int = 0  # distinct LoRA adapters among running requests; 0 = LoRA off (lora_id must be 0)
    # recompute | swap (preempted requests' KV waits in the host tier: needs one)
    preemption_mode: str = attrs.field(default="recompute", validator=attrs.validators.in_(PREEMPTION_MODES))
    # The model's vocabulary, for request_check.py (from the resolved EngineConfig);
    # None only for a core built without a checkpoint (unit tests).
    vocab_size: int | None = None
    max_queue_time_s: float = 0.0  # 0 = off; else drop waiting requests that never ran (queue_timeout.py)
    # > 0: every attention layer sees only its last sliding_window keys; the KV blocks
    # behind the window are freed as requests advance (kv_tiers/block_pool.py). 0: off.
    sliding_window: int = 0
    # --async-scheduling (in_flight.py): up to two steps in flight, the second planned while the
    # first runs; False: each step is planned after the last one returned.
    async_scheduling: bool = False
    # Plan ahead only while at most this many requests run (0: any number; the unset flag's limit,
    # config.py ASYNC_AUTO_MAX_RUNNING); with more, each step waits for the last one's result.
    async_max_running: int = 0
    # --num-scheduler-steps (multi_step.py): forwards a decode step may run on the executor; 1: one.
    num_scheduler_steps: int = attrs.field(default=1, validator=_positive)
    # --stream-interval (request.py Request.delta): tokens a request's delta waits for.
    stream_interval: int = attrs.field(default=1, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold splits prompts: it needs chunked prefill")

    @classmethod
    def from_engine(cls, engine) -> "SchedulerConfig":
        """From an `EngineConfig` (resolved: num_blocks and max_model_len set)."""
        return cls(
            num_blocks=engine.num_blocks,
            block_size=engine.block_size,
            max_num_seqs=engine.max_num_seqs,
            max_num_batched_tokens=engine.max_num_batched_tokens,
            max_model_len=engine.max_model_len,
            enable_prefix_caching=engine.enable_prefix_caching,
            policy=engine.scheduling_policy,
            max_loras=engine.max_loras if engine.enable_lora else 0,
            preemption_mode=engine.preemption_mode,
            vocab_size=engine.vocab_size or None,
            max_queue_time_s=engine.max_queue_time_s,
            sliding_window=engine.kv_sliding_window,
            async_scheduling=bool(engine.async_scheduling),
            async_max_running=engine.async_max_running,
            num_scheduler_steps=engine.num_scheduler_steps,
            stream_interval=engine.stream_interval,
        )

    @property
    def max_chunk_tokens(self) -> int:
        """The most tokens one step schedules for one request."""
        threshold = self.long_prefill_token_threshold
        return min(self.max_num_batched_tokens, threshold) if threshold else self.max_num_batched_tokens

    def num_new_tokens(self, num_tokens: int, num_computed: int, budget: int) -> int:
        """Tokens to compute for a request this step (it knows `num_tokens`, has
        `num_computed`); 0 if it must wait for a bigger budget."""
        num = num_tokens - num_computed
        threshold = self.long_prefill_token_threshold
        if 0 < threshold < num:
            num = threshold
        if num > budget:
            return budget if self.enable_chunked_prefill else 0
        return num
