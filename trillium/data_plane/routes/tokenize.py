"""POST /tokenize and /detokenize, vLLM's shapes.

    /tokenize   {"prompt": str, "add_special_tokens": true}           -> {"tokens", "count", "max_model_len"}
                {"messages": [...], "add_generation_prompt": true}     (chat template applied, as
                 + tools, chat_template, chat_template_kwargs,          /v1/chat/completions applies it)
                   continue_final_message
                "return_token_strs": true                              -> also "token_strs"
    /detokenize {"tokens": [int]}                                      -> {"prompt": str}
"""

from __future__ import annotations

from quart import Blueprint, request

from trillium.data_plane.chat_reply import template_arguments
from trillium.data_plane.errors import bad_request
from trillium.data_plane.protocol import DetokenizeRequest, TokenizeRequest, parse_request
from trillium.data_plane.state import AppState
from trillium.data_plane.streaming import json_response
from trillium.data_plane.tool_choice import plan_tools


def blueprint(state: AppState) -> Blueprint:
    bp = Blueprint("tokenize", __name__)

    @bp.post("/tokenize")
    async def tokenize():
        req = parse_request(TokenizeRequest, await request.get_data())
        state.resolve_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("prompt: give exactly one of 'prompt' or 'messages'", "prompt")
        if req.prompt is not None:
            _no_chat_fields(req)
            add_special = req.add_special_tokens is not False
            tokens = await state.tokenizer.encode(req.prompt, add_special_tokens=add_special)
        else:
            tokens = await _encode_messages(state, req)
        reply = {"tokens": tokens, "count": len(tokens), "max_model_len": state.engine.max_model_len}
        if req.return_token_strs:
            reply["token_strs"] = await state.tokenizer.token_strings(tokens)
        return json_response(reply)

    @bp.post("/detokenize")
    async def detokenize():
        req = parse_request(DetokenizeRequest, await request.get_data())
        state.resolve_model(req.model)
        vocab_size = state.engine.vocab_size
        state.limits.check_num_tokens(req.tokens, state.engine.max_model_len, "tokens")  # before walking them
        if any(not 0 <= t < vocab_size for t in req.tokens):
            raise bad_request(f"tokens: token ids must be in [0, {vocab_size})", "tokens")
        return json_response({"prompt": await state.tokenizer.decode(req.tokens)})

    return bp


_CHAT_FIELDS = ("continue_final_message", "chat_template", "chat_template_kwargs", "tools")


def _no_chat_fields(req: TokenizeRequest) -> None:
    for name in _CHAT_FIELDS:
        if getattr(req, name) not in (None, False):
            raise bad_request(f"{name}: only applies with 'messages'", name)


async def _encode_messages(state: AppState, req: TokenizeRequest) -> list[int]:
    """The conversation's prompt ids exactly as /v1/chat/completions builds them."""
    add_generation_prompt = req.add_generation_prompt is not False
    if req.continue_final_message and add_generation_prompt:
        raise bad_request("continue_final_message: cannot be set together with add_generation_prompt",
                          "continue_final_message")
    tools = plan_tools(req.tools, "none", None, state.engine.chat)  # checked; rendered, never parsed
    _, tokens = await state.tokenizer.render_chat(
        [m.to_template() for m in req.messages],
        add_generation_prompt=add_generation_prompt,
        add_special_tokens=bool(req.add_special_tokens),
        template_kwargs=req.chat_template_kwargs,
        continue_final_message=bool(req.continue_final_message),
        template_arguments=template_arguments(req, state.engine.chat, tools),
    )
    return tokens
