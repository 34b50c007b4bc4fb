"""The data plane through the official openai SDK: what an application sees.

Greedy outputs equal a direct EngineClient run on the same token ids;
streamed text equals non-streamed text; n=3 with a seed is reproducible;
stop strings cut; both logprob formats are filled; usage is exact.
"""

from __future__ import annotations

import math

import openai
import pytest
import trio

from support.data_plane_server import MODEL_NAME
from trillium.sampling_params import SamplingParams

PROMPT = "Once upon a time"


@pytest.fixture
async def sdk(dp_server):
    client = openai.AsyncOpenAI(base_url=dp_server.url() + "/v1", api_key="unused", max_retries=0)
    async with client:
        yield client


async def _direct(dp_server, prompt_ids: list[int], params: SamplingParams) -> tuple[list[int], str, str]:
    """Token ids, text and finish reason from the engine itself (no HTTP)."""
    client = dp_server.client
    eos = tuple(dp_server.tokenizer.eos_token_ids)

    async def run():
        (stream,) = await client.generate(f"direct-{id(params)}-{len(prompt_ids)}", prompt_ids, params, eos)
        ids, text, reason = [], "", None
        async for delta in stream:
            ids.extend(delta.new_token_ids)
            text += delta.text
            reason = delta.finish_reason if delta.finished else reason
        return ids, text, reason

    return await dp_server.call(run)


async def test_completion_greedy_matches_engine_and_stream(dp_server, sdk):
    prompt_ids = dp_server.tokenizer.encode(PROMPT)
    ids, text, reason = await _direct(dp_server, prompt_ids, SamplingParams(temperature=0, max_tokens=12))

    result = await sdk.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    assert result.object == "text_completion" and result.id.startswith("cmpl-")
    assert result.model == MODEL_NAME
    assert result.choices[0].text == text
    assert result.choices[0].finish_reason == reason
    assert result.usage.prompt_tokens == len(prompt_ids)
    assert result.usage.completion_tokens == len(ids)
    assert result.usage.total_tokens == len(prompt_ids) + len(ids)

    chunks = [c async for c in await sdk.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )]
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)
    assert all(c.usage is None for c in chunks[:-1])


async def test_completion_token_prompts_and_choice_order(dp_server, sdk):
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    result = await sdk.completions.create(
        model=MODEL_NAME, prompt=prompts, max_tokens=4, temperature=0, n=2, extra_body={"ignore_eos": True},
    )
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    for p, ids in enumerate(prompts):
        _, text, _ = await _direct(dp_server, ids, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert result.choices[2 * p].text == text == result.choices[2 * p + 1].text
    assert result.usage.prompt_tokens == 7
    assert result.usage.completion_tokens == 16


async def test_chat_greedy_matches_engine_and_stream(dp_server, sdk):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell a story."}]
    prompt_ids = dp_server.tokenizer.encode_chat(messages)
    ids, text, reason = await _direct(dp_server, prompt_ids, SamplingParams(temperature=0, max_tokens=10))

    result = await sdk.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0)
    assert result.object == "chat.completion" and result.id.startswith("chatcmpl-")
    message = result.choices[0].message
    assert message.role == "assistant" and message.content == text
    assert result.choices[0].finish_reason == reason
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(prompt_ids), len(ids))

    # content as a list of text parts renders the same prompt
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
             messages[1]]
    stream = await sdk.chat.completions.create(
        model=MODEL_NAME, messages=parts, max_completion_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [reason]
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids)
    assert chunks[-1].usage.completion_tokens == len(ids)


async def test_n3_seeded_sampling_is_reproducible(sdk):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, n=3, seed=1234, temperature=1.0,
                  extra_body={"ignore_eos": True})
    first = await sdk.completions.create(**kwargs)
    second = await sdk.completions.create(**kwargs)
    texts = [c.text for c in first.choices]
    assert len(texts) == 3 and texts == [c.text for c in second.choices]
    assert len(set(texts)) > 1, "choices sample with seed + i: they should differ"
    assert first.usage.completion_tokens == 24

    chat_kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=6, n=3,
                       seed=7, extra_body={"ignore_eos": True})
    a = await sdk.chat.completions.create(**chat_kwargs)
    b = await sdk.chat.completions.create(**chat_kwargs)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]


async def test_stop_strings(sdk):
    free = await sdk.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0,
                                        extra_body={"ignore_eos": True})
    text = free.choices[0].text
    stop = next((text[i:i + 3] for i in range(2, len(text) - 3) if text[i:i + 3].strip()), None)
    assert stop, f"greedy text too short to cut: {text!r}"
    cut = await sdk.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0,
                                       stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    kept = await sdk.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                        extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == text[: text.index(stop) + len(stop)]


async def test_completion_logprobs_legacy_format(sdk):
    result = await sdk.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0,
                                          logprobs=3, extra_body={"ignore_eos": True})
    lp = result.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 3 <= len(top) <= 4
        assert top[token] == pytest.approx(logprob)
        assert max(top.values()) == pytest.approx(logprob), "greedy picks the top token"

    echoed = await sdk.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0,
                                          logprobs=1, echo=True)
    elp = echoed.choices[0].logprobs
    assert echoed.choices[0].text.startswith(PROMPT)
    assert elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
    assert all(v is not None for v in elp.token_logprobs[1:])


async def test_chat_logprobs_format(sdk):
    result = await sdk.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True},
    )
    content = result.choices[0].logprobs.content
    assert len(content) == 5 == result.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and math.isfinite(entry.logprob)
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token

    stream = await sdk.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=1, stream=True, extra_body={"ignore_eos": True},
    )
    streamed = [e async for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]


async def test_models_endpoint(sdk):
    models = await sdk.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    card = models.data[0]
    assert card.object == "model" and card.owned_by == "trillium"
    assert card.model_extra["max_model_len"] == 2048
    assert (await sdk.models.retrieve(MODEL_NAME)).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        await sdk.models.retrieve("nope")


async def test_many_concurrent_streams_complete_with_usage(dp_server, sdk):
    num_streams = 32
    results: dict[int, tuple[str, int]] = {}

    async def one(i: int) -> None:
        stream = await sdk.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": f"story number {i}"}],
            max_tokens=4 + i % 5, temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage is not None:
                usage = chunk.usage
        results[i] = (text, usage.completion_tokens)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for i in range(num_streams):
                nursery.start_soon(one, i)
    assert sorted(results) == list(range(num_streams))
    for i, (text, completion_tokens) in results.items():
        assert completion_tokens == 4 + i % 5
    # each stream's text equals the same request unstreamed
    for i in (0, 13, 31):
        alone = await sdk.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": f"story number {i}"}],
            max_tokens=4 + i % 5, temperature=0, extra_body={"ignore_eos": True},
        )
        assert alone.choices[0].message.content == results[i][0]
    assert dp_server.num_in_flight() == 0
