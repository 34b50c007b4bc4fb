"""generation_config.json's sampling defaults, applied as vLLM applies them.

Mirrors vllm-project/vllm vllm/config/model.py `ModelConfig.get_diff_sampling_param`
(the six fields repetition_penalty, temperature, top_k, top_p, min_p,
max_new_tokens -> max_tokens; non-default values of transformers'
GenerationConfig only; `--generation-config vllm` reads nothing; a folder
is read instead of the model's; --override-generation-config updates the
result in every mode) and vllm/entrypoints/utils.py `get_max_tokens` (a
request's max_tokens is capped by the default's and by what the context
leaves). Request fields override the others (vLLM's
`to_sampling_params(default_sampling_params=...)`).
"""

from __future__ import annotations

import json

import pytest

from trillium.data_plane.errors import ApiError
from trillium.data_plane.generate_request import check_generate_prompt, parse_generate
from trillium.data_plane.protocol import ChatCompletionRequest, CompletionRequest
from trillium.data_plane.sampling import chat_params, check_prompt, completion_params
from trillium.generation_defaults import NO_DEFAULTS, load_sampling_defaults

GENERATION = {"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, "temperature": 0.6, "top_p": 0.9,
              "top_k": 20, "repetition_penalty": 1.05, "max_new_tokens": 7}


def write_generation_config(folder, values) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(values))
    return str(folder)


def test_auto_reads_the_models_sampling_fields(tmp_path):
    defaults = load_sampling_defaults(write_generation_config(tmp_path / "m", GENERATION))
    assert defaults.values == {"repetition_penalty": 1.05, "temperature": 0.6, "top_k": 20, "top_p": 0.9,
                               "max_tokens": 7}
    assert "temperature=0.6" in defaults.describe()


def test_only_the_six_sampling_fields_are_defaults(tmp_path):
    # do_sample, num_beams, token ids, ...: not sampling defaults in vLLM either.
    defaults = load_sampling_defaults(write_generation_config(tmp_path / "m", {
        "do_sample": True, "num_beams": 1, "eos_token_id": 2, "pad_token_id": 0, "min_p": 0.05}))
    assert defaults.values == {"min_p": 0.05}


def test_vllm_mode_reads_nothing_but_overrides_still_apply(tmp_path):
    model = write_generation_config(tmp_path / "m", GENERATION)
    assert load_sampling_defaults(model, "vllm").values == {}
    assert load_sampling_defaults(model, "vllm", '{"temperature": 0.3}').values == {"temperature": 0.3}


def test_folder_mode_and_overrides(tmp_path):
    model = write_generation_config(tmp_path / "m", GENERATION)
    other = write_generation_config(tmp_path / "other", {"temperature": 0.2})
    assert load_sampling_defaults(model, other).values == {"temperature": 0.2}
    merged = load_sampling_defaults(model, "auto", {"temperature": 0.1, "max_new_tokens": 3})
    assert merged.values["temperature"] == 0.1 and merged.values["max_tokens"] == 3
    with pytest.raises(ValueError, match="auto, vllm or a folder"):
        load_sampling_defaults(model, str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="expected a number"):
        load_sampling_defaults(model, "auto", {"temperature": "hot"})


def test_a_model_without_generation_config_has_no_defaults(tmp_path):
    (tmp_path / "m").mkdir()
    assert load_sampling_defaults(str(tmp_path / "m")).values == {}


def test_completion_and_chat_fill_only_what_the_request_left_unset(tmp_path):
    defaults = load_sampling_defaults(write_generation_config(tmp_path / "m", GENERATION))
    params = completion_params(CompletionRequest(prompt="hi", temperature=0.0), defaults)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.0, 0.9, 20, 1.05)
    assert params.max_tokens == 7  # min(the completions API's default 16, the model's 7), as in vLLM
    chat = chat_params(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], top_k=5,
                                             max_completion_tokens=100), defaults)
    assert (chat.temperature, chat.top_k, chat.max_tokens) == (0.6, 5, 7)  # min(100, 7)
    neutral = completion_params(CompletionRequest(prompt="hi"), NO_DEFAULTS)
    assert (neutral.temperature, neutral.top_k, neutral.repetition_penalty) == (1.0, -1, 1.0)


def test_default_max_tokens_is_capped_by_the_context(tmp_path):
    defaults = load_sampling_defaults(write_generation_config(tmp_path / "m", GENERATION))
    params = chat_params(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]), defaults)
    assert params.max_tokens is None  # chat leaves it open: filled per prompt by check_prompt
    checked = check_prompt([5] * 4, params, vocab_size=100, max_model_len=64, renames={},
                           default_max_tokens=defaults.default_max_tokens)
    assert checked.max_tokens == 7
    near_end = check_prompt([5] * 60, params, vocab_size=100, max_model_len=64, renames={},
                            default_max_tokens=defaults.default_max_tokens)
    assert near_end.max_tokens == 4


def test_sglang_generate_takes_the_sampling_defaults(tmp_path):
    defaults = load_sampling_defaults(write_generation_config(tmp_path / "m", GENERATION))
    req = parse_generate(json.dumps({"text": "hi", "sampling_params": {"top_p": 0.5}}).encode())
    params = check_generate_prompt([5, 6], req.prompts[0], prompt_field="text", vocab_size=100, max_model_len=256,
                                   defaults=defaults)
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.5, 20)


def test_max_logprobs_caps_requests():
    with pytest.raises(ApiError) as info:
        completion_params(CompletionRequest(prompt="hi", logprobs=6), NO_DEFAULTS, max_logprobs=5)
    assert info.value.status == 400 and "--max-logprobs" in str(info.value.message)
    with pytest.raises(ApiError):
        chat_params(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logprobs=True,
                                          top_logprobs=3), NO_DEFAULTS, max_logprobs=2)
    req = parse_generate(json.dumps({"text": "hi", "return_logprob": True, "top_logprobs_num": 4}).encode())
    with pytest.raises(ApiError):
        check_generate_prompt([5], req.prompts[0], prompt_field="text", vocab_size=100, max_model_len=64,
                              max_logprobs=3)
