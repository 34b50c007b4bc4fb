"""Offline API: `LLM(model=PATH).generate(prompts, params)` and `.chat(...)`.

Runs the real engine actors (executor, detokenizer, scheduler) in one
process over inproc:// ZeroMQ, on a trio loop in a background thread; the
caller's thread submits work with `trio.from_thread`. With
`tensor_parallel_size=N > 1` the actors run as child processes over ipc://
instead (one process per executor rank, as `trillium serve` starts them:
torch.distributed ranks cannot share one process). Inputs are validated
here, before anything reaches the engine, so bad input raises ValueError
naming the parameter and never disturbs other requests.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence

import attrs
import trio

from trillium.actors.client import EngineClient
from trillium.actors.assembly import ActorConfig, Addresses, engine_specs
from trillium.actors.protocol.execute import TokenLogprobs
from trillium.actors.supervisor import run_in_process, run_in_subprocesses
from trillium.config import EngineConfig
from trillium.outputs import CompletionOutput, Logprob, RequestOutput
from trillium.sampling_params import SamplingParams
from trillium.validation import check_request

log = logging.getLogger(__name__)

PromptInput = str | Sequence[int] | dict


class LLM:
    """An in-process engine. Keyword arguments are `EngineConfig` fields
    (dtype, max_model_len, max_num_seqs, max_num_batched_tokens, block_size,
    kv_cache_memory, enable_prefix_caching, scheduling_policy,
    otlp_traces_endpoint, collect_detailed_traces, ...).

    With `otlp_traces_endpoint` every request gets an `llm_request` span, as
    under `trillium serve`; `llm.tracing` (observability/tracing.py
    RequestTracing) switches it between `generate` calls.

    With `enable_lora=True` (and max_loras, max_lora_rank, max_cpu_loras),
    `generate(..., lora=LoRARequest(name, path))` runs prompts on a PEFT
    adapter; one call may mix adapters and the base model (a list with one
    LoRARequest or None per prompt)."""

    def __init__(self, model: str, *, revision: str | None = None, download_dir: str | None = None,
                 trust_remote_code: bool = False, **engine_args) -> None:
        from trillium.generation_defaults import load_sampling_defaults
        from trillium.hub import check_no_remote_code, resolve_model_path
        from trillium.models.tokenizer import load_tokenizer
        from trillium.observability.tracing import RequestTracing

        # vLLM's LLM(model=...) arguments: a Hub id resolves into the HF cache (trillium/hub.py).
        model = resolve_model_path(model, revision, download_dir)
        check_no_remote_code(model, trust_remote_code)
        if engine_args.get("tokenizer"):
            engine_args["tokenizer"] = resolve_model_path(engine_args["tokenizer"], None, download_dir)
        if engine_args.get("kv_cache_memory") is None:  # vLLM's VLLM_CPU_KVCACHE_SPACE on CPU
            import os

            from trillium.config import kv_cache_memory_default

            engine_args["kv_cache_memory"] = kv_cache_memory_default(engine_args.get("device", "cpu"), os.environ)
        self.config = EngineConfig.build(model=model, **engine_args).resolve()
        self.tokenizer = load_tokenizer(self.config.tokenizer_path)
        # vLLM's LLM.get_default_sampling_params: generation_config.json's defaults when
        # generate() / chat() get no SamplingParams.
        self.sampling_defaults = load_sampling_defaults(model, self.config.generation_config,
                                                        self.config.override_generation_config)
        log.info("%s", self.sampling_defaults.describe())
        self.tracing = RequestTracing.from_config(self.config, "api")
        self._ipc_dir = None
        if self.config.tensor_parallel_size > 1:  # ranks are processes: so are their peers (ipc://)
            from trillium.actors.ipc_dir import make_ipc_dir

            self._ipc_dir = make_ipc_dir()
        addresses = Addresses.inproc() if self._ipc_dir is None else Addresses.ipc(self._ipc_dir)
        self._actor_config = ActorConfig(self.config, addresses)
        self._ids = itertools.count()
        self._loras: dict[str, tuple[int, str]] = {}  # name -> (engine lora_id, path)
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._client: EngineClient | None = None
        self._stop: trio.Event | None = None
        self._thread = threading.Thread(target=self._thread_main, name="trillium-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            self.tracing.close()
            raise RuntimeError(f"engine failed to start: {self._failure}") from self._failure
        from trillium.pooling.offline import PoolingRunner

        self._pooling = PoolingRunner(self)  # embed / classify / reward / score (pooling/offline.py)

    # -- engine thread -------------------------------------------------

    def _thread_main(self) -> None:
        try:
            trio.run(self._engine_main)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller thread
            self._failure = exc
            log.error("engine stopped: %s", exc)
        finally:
            self._ready.set()

    async def _engine_main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        client = EngineClient(self._actor_config)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(client.run)
                run = run_in_process if self._ipc_dir is None else run_in_subprocesses
                await nursery.start(run, engine_specs(self._actor_config))
                self._client = client
                self._ready.set()
                await self._stop.wait()
                nursery.cancel_scope.cancel()
        finally:
            client.close()

    def _call(self, fn, *args):
        if self._failure is not None or not self._thread.is_alive():
            raise RuntimeError(f"the engine is not running: {self._failure}")
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    def shutdown(self) -> None:
        if self._thread.is_alive() and self._stop is not None:
            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            self._thread.join(timeout=30)
        self.tracing.close()
        if self._ipc_dir is not None:
            import shutil

            shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- public API ----------------------------------------------------

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json defaults (vLLM's method)."""
        defaults = self.sampling_defaults
        kwargs = defaults.fill({})
        if defaults.default_max_tokens is not None:
            kwargs["max_tokens"] = defaults.default_max_tokens
        return SamplingParams(**kwargs)

    def get_stats(self):
        """The engine's latest per-step SchedulerStats (None before the first step)."""
        return self._client.last_stats if self._client is not None else None

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        lora=None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text, token ids, or {"prompt_token_ids": [...]}).

        `lora`: a LoRARequest for every prompt, or one LoRARequest / None per prompt."""
        if self.config.runner == "pooling":
            raise ValueError("generate: this is a pooling model (runner='pooling'); use embed, classify, "
                             "reward or score")
        items = self._normalize_prompts(prompts)
        params = _broadcast_params(sampling_params, len(items), self.get_default_sampling_params())
        prepared = [self._prepare(text, ids, p) for (text, ids), p in zip(items, params)]
        priorities = list(priority) if priority is not None else [0] * len(prepared)
        if len(priorities) != len(prepared):
            raise ValueError("priority: needs one value per prompt")
        loras = list(lora) if isinstance(lora, (list, tuple)) else [lora] * len(prepared)
        if len(loras) != len(prepared):
            raise ValueError("lora: needs one LoRARequest (or None) per prompt")
        lora_ids = [self._lora_id(request) for request in loras]
        return self._call(self._generate_async, prepared, priorities, lora_ids)

    # -- pooling models (vLLM's names; trillium/pooling/offline.py) ----------

    def encode(self, prompts, *, pooling_task: str | None = None, dimensions: int | None = None,
               use_activation: bool | None = None):
        """One PoolingRequestOutput per prompt (`.outputs.data`) for `pooling_task`: embed, classify,
        or per token token_embed / token_classify (a row per prompt token; STEP: its filtered rows)."""
        return self._pooling.encode(prompts, pooling_task=pooling_task, dimensions=dimensions,
                                    use_activation=use_activation)

    def embed(self, prompts, *, dimensions: int | None = None, normalize: bool | None = None):
        """One EmbeddingRequestOutput per prompt (`.outputs.embedding`); `dimensions`: Matryoshka size."""
        return self._pooling.embed(prompts, dimensions=dimensions, normalize=normalize)

    def classify(self, prompts, *, use_activation: bool | None = None):
        """One ClassificationRequestOutput per prompt (`.outputs.probs`: softmax, or sigmoid for one label)."""
        return self._pooling.classify(prompts, use_activation=use_activation)

    def reward(self, prompts):
        """One PoolingRequestOutput per prompt (`.outputs.data`: the classifier's raw scores)."""
        return self._pooling.reward(prompts)

    def score(self, data_1, data_2, *, use_activation: bool | None = None):
        """One ScoringRequestOutput per (data_1, data_2) pair (`.outputs.score`)."""
        return self._pooling.score(data_1, data_2, use_activation=use_activation)

    def _lora_id(self, request) -> int:
        """The engine id of `request`'s adapter, loading it on first use (ValueError if it cannot be)."""
        if request is None:
            return 0
        if not self.config.enable_lora:
            raise ValueError("lora: this LLM was built without enable_lora=True")
        known = self._loras.get(request.lora_name)
        if known is not None:
            if known[1] != str(request.lora_path):
                raise ValueError(f"lora: {request.lora_name!r} is already loaded from {known[1]}")
            return known[0]
        from trillium.actors.protocol.admin import LoadLoRAAdapter

        lora_id = request.lora_int_id or 1 + max((i for i, _ in self._loras.values()), default=0)
        command = LoadLoRAAdapter(f"lora-{lora_id}", lora_id, request.lora_name, str(request.lora_path))
        reply = self._call(self._client.control, command)
        if not reply.ok:
            raise ValueError(f"lora: {reply.message}")
        self._loras[request.lora_name] = (lora_id, str(request.lora_path))
        return lora_id

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
        tools: Sequence[dict] | None = None,
        lora=None,
    ) -> list[RequestOutput]:
        """Apply the chat template to one or more conversations and generate (vLLM's `LLM.chat`).

        `tools` (OpenAI function tools) and `chat_template_kwargs` reach the template as
        `transformers`' apply_chat_template passes them; the replies are text, as vLLM's
        `LLM.chat` returns them (no tool-call parsing offline). `chat_template` replaces the
        model's; `continue_final_message` leaves the last message open (not with
        add_generation_prompt). `lora` as in `generate`."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not conversations:
            raise ValueError("messages: at least one conversation is required")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message: cannot be set together with add_generation_prompt")
        template_args = dict(chat_template_kwargs or {})
        if continue_final_message:
            template_args["continue_final_message"] = True
        for name, value in (("chat_template", chat_template), ("tools", None if tools is None else list(tools))):
            if value is not None:
                template_args[name] = value
        prompts = []
        for conversation in conversations:
            ids = self.tokenizer.encode_chat(list(conversation), add_generation_prompt=add_generation_prompt,
                                             **template_args)
            prompts.append({"prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, lora=lora)

    # -- helpers -------------------------------------------------------

    def _normalize_prompts(self, prompts) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        if not isinstance(prompts, Sequence) or len(prompts) == 0:
            raise ValueError("prompts: at least one prompt is required")
        items = []
        for prompt in prompts:
            if isinstance(prompt, str):
                items.append((prompt, list(self.tokenizer.encode(prompt))))
            elif isinstance(prompt, dict):
                if "prompt_token_ids" in prompt:
                    items.append((prompt.get("prompt"), list(prompt["prompt_token_ids"])))
                elif "prompt" in prompt:
                    items.append((prompt["prompt"], list(self.tokenizer.encode(prompt["prompt"]))))
                else:
                    raise ValueError("prompts: a dict prompt needs 'prompt' or 'prompt_token_ids'")
            elif isinstance(prompt, Sequence):
                items.append((None, list(prompt)))
            else:
                raise ValueError(f"prompts: unsupported prompt type {type(prompt).__name__}")
        return items

    def _prepare(self, text, ids: list[int], params: SamplingParams):
        if params.thinking_token_budget is not None and not (params.think_start_token_ids
                                                             or params.think_end_token_ids):
            # As the server's --reasoning-parser does: the thinking is <think> ... </think>.
            params = attrs.evolve(
                params, think_start_token_ids=tuple(self.tokenizer.encode("<think>", add_special_tokens=False)),
                think_end_token_ids=tuple(self.tokenizer.encode("</think>", add_special_tokens=False)))
        params = check_request(
            ids, params, vocab_size=self.model_vocab_size, max_model_len=self.config.max_model_len
        )
        return text, ids, params

    @property
    def model_vocab_size(self) -> int:
        from trillium.models.loader import load_model_config

        if not hasattr(self, "_vocab_size"):
            self._vocab_size = load_model_config(self.config.model).vocab_size
        return self._vocab_size

    async def _generate_async(self, prepared, priorities, lora_ids) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(prepared)
        async with trio.open_nursery() as nursery:
            for index, ((text, ids, params), prio, lora_id) in enumerate(zip(prepared, priorities, lora_ids)):
                nursery.start_soon(self._run_one, index, text, ids, params, prio, lora_id, results)
        return results  # type: ignore[return-value]

    async def _run_one(self, index, text, ids, params: SamplingParams, priority, lora_id, results) -> None:
        request_id = str(next(self._ids))
        # WHY final_only: generate returns whole outputs, so the engine may hold the tokens in chunks
        # (vLLM's LLM asks for FINAL_ONLY outputs too)
        streams = await self._client.generate(
            request_id, ids, attrs.evolve(params, final_only=True), tuple(self.tokenizer.eos_token_ids),
            priority=priority, trace=self.tracing.sample(), lora_id=lora_id,
        )
        outputs = [CompletionOutput(index=i) for i in range(len(streams))]
        output = RequestOutput(request_id=request_id, prompt=text, prompt_token_ids=ids, outputs=outputs)
        want_logprobs = params.logprobs is not None
        async with trio.open_nursery() as nursery:
            for completion, stream in zip(outputs, streams):
                nursery.start_soon(self._collect, completion, stream, output, want_logprobs)
        output.finished = True
        results[index] = output

    async def _collect(self, completion: CompletionOutput, stream, output: RequestOutput, want_logprobs: bool):
        if want_logprobs:
            completion.logprobs = []
            completion.cumulative_logprob = 0.0
        async for delta in stream:
            completion.text += delta.text
            completion.token_ids.extend(delta.new_token_ids)
            if want_logprobs:
                for entry in delta.logprobs:
                    completion.logprobs.append(self._logprob_dict(entry))
                    completion.cumulative_logprob += entry.logprob
            if delta.prompt_logprobs is not None and completion.index == 0:
                output.prompt_logprobs = output.prompt_logprobs or [None]
                output.prompt_logprobs.extend(self._logprob_dict(e) for e in delta.prompt_logprobs.entries)
            if delta.num_cached_tokens:
                output.num_cached_tokens = delta.num_cached_tokens
            if delta.finished:
                completion.finish_reason = delta.finish_reason
                completion.stop_reason = delta.stop_reason

    def _logprob_dict(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        decode = self.tokenizer.decode
        result = {
            entry.token_id: Logprob(entry.logprob, entry.rank, decode([entry.token_id]))
        }
        for rank, (tid, lp) in enumerate(zip(entry.top_token_ids, entry.top_logprobs), start=1):
            if tid not in result:
                result[tid] = Logprob(lp, rank, decode([tid]))
        return result


def _broadcast_params(params, count: int, default: SamplingParams) -> list[SamplingParams]:
    if params is None:
        return [default] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"sampling_params: got {len(params)} for {count} prompts")
    return params
