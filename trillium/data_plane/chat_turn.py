"""The chat path's request-start steps, run once for the three chat-shaped APIs.

/v1/chat/completions (routes/chat.py), /v1/responses (routes/responses.py)
and /v1/messages (routes/messages.py) each turn their body into a
`ChatCompletionRequest` and then take the same steps up to the engine
request: resolve the model, sample a trace, sampling params, the tool plan,
the priority check, the chat template, the reply format (reasoning and tool
parsers), the structured-output constraint, vLLM's truncate_prompt_tokens
and bad_words, the prompt check, admission and submission.
`start_chat_turn` runs them in that order and returns what the routes write
their replies from. Each route keeps only what is its own: the wire format
in, the renaming of error params to its wire names, and the reply out.

WHY one function and not three copies: a field handled on one route and
forgotten on another is a silent no-op on that route (the Responses and
Messages bodies reach these steps through fields they set on the chat
request), and the order of the steps decides which 400 a bad body gets.
"""

from __future__ import annotations

import functools

import attrs
from quart import request

from trillium.data_plane.chat_reply import ReplyFormat, constrain, reply_format, template_arguments, template_kwargs
from trillium.data_plane.errors import bad_request
from trillium.data_plane.generation import Generation
from trillium.data_plane.protocol import ChatCompletionRequest
from trillium.data_plane.rollout_fields import RequestIds, bad_words_token_ids, truncate_prompt
from trillium.data_plane.sampling import chat_params, check_priority, check_prompt
from trillium.data_plane.state import AppState
from trillium.data_plane.tool_choice import ToolPlan, plan_tools
from trillium.observability.tracing import sample_request
from trillium.sampling_params import SamplingParams


@attrs.frozen
class ChatTurn:
    """A submitted chat request: what its reply is written from."""

    model: str  # the served name asked for
    prompt_ids: list[int]  # as submitted (after truncate_prompt_tokens)
    params: SamplingParams  # as checked and submitted
    reply: ReplyFormat  # how the text is read back (reasoning, tool calls)
    generation: Generation
    add_generation_prompt: bool  # as rendered (False: the reply continues the last message)


def add_generation_prompt(chat: ChatCompletionRequest) -> bool:
    """add_generation_prompt as rendered: off when continuing the final message
    (sending both as true is vLLM's 400)."""
    if not chat.continue_final_message:
        return chat.add_generation_prompt is not False
    if "add_generation_prompt" in chat.model_fields_set and chat.add_generation_prompt:
        raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                          "continue_final_message")
    return False


async def render_chat_prompt(state: AppState, chat: ChatCompletionRequest, tools: ToolPlan) -> tuple[str, list[int]]:
    """(text, token ids) of `chat`'s conversation through the chat template, with `tools`."""
    return await state.tokenizer.render_chat(
        [m.to_template() for m in chat.messages],
        add_generation_prompt=add_generation_prompt(chat),
        add_special_tokens=bool(chat.add_special_tokens),
        template_kwargs=template_kwargs(chat),
        continue_final_message=bool(chat.continue_final_message),
        template_arguments=template_arguments(chat, state.engine.chat, tools),
    )


async def start_chat_turn(state: AppState, chat: ChatCompletionRequest, ids: RequestIds,
                          renames: dict[str, str], *, stream: bool) -> ChatTurn:
    """The steps of the module docstring for `chat`, up to the submitted engine request.
    `renames`: engine parameter names -> the route's wire names, for check_prompt's 400s.
    `stream`: the reply streams (else the engine may hold its tokens in chunks: final_only). NOTE:
    not for a reply whose thinking is split out: its reasoning_tokens are found by decoding the delta
    where the thinking ends (chat_reply.py), which stays a chunk of tokens, not a whole reply, so that
    work stays small on the api's event loop."""
    engine = state.engine
    model = state.resolve_model(chat.model)
    trace = sample_request(engine.tracing, request.headers, model)  # None unless traced
    params = chat_params(chat, engine.defaults, engine.max_logprobs)
    tools = plan_tools(chat.tools, chat.tool_choice, chat.parallel_tool_calls, engine.chat)
    if chat.priority:
        check_priority(chat.priority, engine.client.config.engine.scheduling_policy)
    prompt_text, prompt_ids = await render_chat_prompt(state, chat, tools)
    reply = reply_format(chat, engine.chat, tools, prompt_text)
    params = await constrain(params, reply, state.tokenizer.encode_plain)
    if reply.reasoning is not None:
        reply = attrs.evolve(reply, decode=functools.partial(state.tokenizer.tokenizer.decode,
                                                             skip_special_tokens=params.skip_special_tokens))
    prompt_ids = truncate_prompt(prompt_ids, chat.truncate_prompt_tokens, chat.truncation_side,
                                 engine.max_model_len)
    words = await bad_words_token_ids(chat.bad_words, state.tokenizer.encode_plain)
    if words:
        params = attrs.evolve(params, bad_words_token_ids=words)
    checked = check_prompt(prompt_ids, params, vocab_size=engine.vocab_size, max_model_len=engine.max_model_len,
                           renames=renames, default_max_tokens=engine.defaults.default_max_tokens)
    generation = state.admit([checked])
    await generation.submit(ids.engine_id, [prompt_ids], [checked], engine.resolved_eos_token_ids,
                            priority=chat.priority or 0, trace=trace, lora_id=state.lora_id(model),
                            cache_salt=chat.cache_salt, final_only=not stream and reply.reasoning is None)
    return ChatTurn(model, prompt_ids, checked, reply, generation, add_generation_prompt(chat))
