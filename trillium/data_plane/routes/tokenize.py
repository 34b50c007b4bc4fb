"""POST /tokenize and /detokenize, vLLM's shapes.

    /tokenize   {"prompt": str, "add_special_tokens": true}           -> {"tokens", "count", "max_model_len"}
                {"messages": [...], "add_generation_prompt": true}     (chat template applied)
    /detokenize {"tokens": [int]}                                      -> {"prompt": str}
"""

from __future__ import annotations

from quart import Blueprint, request

from trillium.data_plane.errors import bad_request
from trillium.data_plane.protocol import DetokenizeRequest, TokenizeRequest, parse_request
from trillium.data_plane.state import AppState
from trillium.data_plane.streaming import json_response


def blueprint(state: AppState) -> Blueprint:
    bp = Blueprint("tokenize", __name__)

    @bp.post("/tokenize")
    async def tokenize():
        req = parse_request(TokenizeRequest, await request.get_data())
        state.resolve_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("prompt: give exactly one of 'prompt' or 'messages'", "prompt")
        if req.prompt is not None:
            add_special = req.add_special_tokens is not False
            tokens = await state.tokenizer.encode(req.prompt, add_special_tokens=add_special)
        else:
            tokens = await state.tokenizer.encode_chat(
                [m.to_template() for m in req.messages],
                add_generation_prompt=req.add_generation_prompt is not False,
                add_special_tokens=bool(req.add_special_tokens),
            )
        return json_response({"tokens": tokens, "count": len(tokens), "max_model_len": state.engine.max_model_len})

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
