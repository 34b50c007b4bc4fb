"""Hub ids resolve through huggingface_hub's cache, offline; remote code is refused.

No network: each test lays a tiny checkpoint out in the Hub cache layout
itself (support/hub_cache.py) and resolves with HF_HUB_OFFLINE semantics,
as vLLM does for `vllm serve org/name` (vllm-project/vllm
vllm/model_executor/model_loader/weight_utils.py `download_weights_from_hf`:
snapshot_download into --download-dir at --revision, local_files_only when
HF_HUB_OFFLINE). The offline `trillium.LLM` run also checks vLLM's
`LLM.get_default_sampling_params` (generation_config.json's defaults when no
SamplingParams are given) and --seed (vllm/engine/arg_utils.py `seed`:
unseeded requests sample reproducibly).
"""

from __future__ import annotations

import json
import shutil

import pytest

from support.hub_cache import populate_hub_cache
from trillium import LLM, SamplingParams
from trillium.hub import check_no_remote_code, resolve_model_path

REPO = "test-org/tiny-llama"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture
def offline(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, checkpoint):
    cache = tmp_path_factory.mktemp("hf-cache")
    source = tmp_path_factory.mktemp("source")
    for file in checkpoint("llama").iterdir():
        shutil.copy(file, source / file.name)
    generation = json.loads((source / "generation_config.json").read_text())
    (source / "generation_config.json").write_text(json.dumps({**generation, "max_new_tokens": 3, "top_k": 1}))
    main = populate_hub_cache(cache, REPO, source)
    other = populate_hub_cache(cache, REPO, checkpoint("llama"), commit=OTHER_COMMIT, ref="v2")
    return {"cache": str(cache), "main": str(main), "v2": str(other)}


def test_hub_id_resolves_to_the_cached_snapshot(hub_cache, offline):
    assert resolve_model_path(REPO, download_dir=hub_cache["cache"]) == hub_cache["main"]
    assert resolve_model_path(REPO, "v2", hub_cache["cache"]) == hub_cache["v2"]
    assert resolve_model_path(REPO, OTHER_COMMIT, hub_cache["cache"]) == hub_cache["v2"]


def test_missing_snapshot_offline_names_the_cache(hub_cache, offline):
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE is set") as info:
        resolve_model_path("test-org/not-cached", download_dir=hub_cache["cache"])
    assert hub_cache["cache"] in str(info.value)
    with pytest.raises(ValueError, match="revision nope"):
        resolve_model_path(REPO, "nope", hub_cache["cache"])


def test_local_paths_are_used_as_they_are(tmp_path):
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ValueError, match="not a Hugging Face Hub id"):
        resolve_model_path(str(tmp_path / "no" / "such" / "dir"))


def test_remote_code_models_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["FancyForCausalLM"], "auto_map": {"AutoModelForCausalLM": "modeling_fancy.FancyLM"}}))
    for trust in (False, True):
        with pytest.raises(ValueError, match="never runs remote code") as info:
            check_no_remote_code(str(tmp_path), trust)
        assert "modeling_fancy.FancyLM" in str(info.value) and "LlamaForCausalLM" in str(info.value)


def test_remote_code_config_of_a_builtin_architecture_loads(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "auto_map": {"AutoConfig": "configuration_x.XConfig"}}))
    check_no_remote_code(str(tmp_path), True)


def test_offline_llm_from_the_cache_applies_generation_defaults_and_seed(hub_cache, offline):
    """LLM("org/name") from the cache: with no SamplingParams the model's max_new_tokens (3) and top_k (1,
    so sampling at temperature 1 is greedy) apply; explicit SamplingParams are used as given."""
    def sample_twice(llm) -> list[list[int]]:
        return [llm.generate(["Once upon a time"], SamplingParams(max_tokens=12))[0].outputs[0].token_ids
                for _ in range(2)]

    with LLM(REPO, download_dir=hub_cache["cache"], kv_cache_memory="4MiB", seed=11) as llm:
        assert llm.config.model == hub_cache["main"]
        sampled = sample_twice(llm)
        defaulted = llm.generate(["Once upon a time"])[0].outputs[0]
        greedy = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0]
    assert len(defaulted.token_ids) == 3 and defaulted.token_ids == greedy.token_ids
    assert sampled[0] != sampled[1]
    with LLM(REPO, download_dir=hub_cache["cache"], kv_cache_memory="4MiB", seed=11) as again:
        assert sample_twice(again) == sampled  # --seed: the same unseeded requests in order sample the same


def test_tokenizer_from_another_folder(checkpoint):
    """vLLM's --tokenizer / LLM(tokenizer=...): the api and the detokenizer load that folder's tokenizer
    (qwen2's adds no BOS; the llama checkpoint's own does)."""
    model, tokenizer = checkpoint("llama"), checkpoint("qwen2")
    with LLM(str(model), tokenizer=str(tokenizer), kv_cache_memory="4MiB") as llm:
        assert llm.config.tokenizer_path == str(tokenizer)
        assert not llm.tokenizer.adds_bos
        out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=4))[0]
    assert out.prompt_token_ids[0] != llm.tokenizer.bos_token_id
    assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
