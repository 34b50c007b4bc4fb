"""Weight updates and the speculative draft (trillium/speculative/draft_weights.py), executor side.

The routing mirrors SGLang's: a weight update is handed to the draft worker
(sgl-project/sglang python/sglang/srt/managers/scheduler_update_weights_mixin.py
update_weights_from_tensor, and eagle_worker_v2.py feeding the same tensors to
the draft runner), `disable_draft_model` in UpdateWeightsFromTensorReqInput
(python/sglang/srt/managers/io_struct.py) keeps it off the draft, and the
SGLang-based RL rollouts send `draft_model_only` to update the draft alone.
Trillium's draft is its own checkpoint, so an update is the target's or the
draft's. Checked here on the executor: a draft update from disk and from
tensors leaves the draft's tensors equal to the file's (target untouched), a
bad one (wrong shape, unknown name, no draft) is a 400 with the old draft
kept, the EAGLE head updates the same way, and every target update drops the
proposer's per-request state (draft KV, head KV, adaptive depth), after which
greedy output is still the non-speculative one.
"""

from __future__ import annotations

import json
import time

import attrs

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from trillium.actors.executor import weights
from trillium.actors.executor.control import ExecutorControl
from trillium.actors.executor.core import ExecutorCore
from trillium.actors.protocol.admin import ControlError
from trillium.actors.protocol.requests import AddRequest
from trillium.actors.scheduler.core import build_scheduler
from trillium.config import EngineConfig
from trillium.models.loader import load_model_config
from trillium.sampling_params import SamplingParams
from trillium.speculative.eagle_checkpoint import head_config_dict, read_config, read_weights, write_checkpoint
from trillium.speculative.eagle import EagleHead

K = 3
ENGINE = dict(num_blocks=24, max_num_batched_tokens=64, max_num_seqs=4)


def _core(target: str, spec: dict) -> tuple[ExecutorCore, ExecutorControl]:
    cfg = EngineConfig.build(model=target, speculative_config=spec, **ENGINE).resolve()
    core = ExecutorCore(cfg)
    return core, ExecutorControl(core, torch_thread=None)  # the sync handlers only: no thread needed


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _head_dir(path, target_config, seed: int) -> str:
    """An untrained one-layer EAGLE head for the target (random weights), in vLLM's format."""
    config = attrs.evolve(target_config, num_layers=1)
    head = EagleHead(config, fc_bias=False, max_positions=64, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    return str(write_checkpoint(path, head_config_dict(target_config), head.hf_weights()))


def _hf_tensor(model, name: str) -> torch.Tensor:
    """The live tensor an HF weight name loaded into (a slice of a fused parameter)."""
    param_name, rows = model.resolve_weight(name)
    tensor = dict(model.named_parameters())[param_name].detach()
    return tensor if rows is None else tensor.narrow(0, rows[0], rows[1])


def test_draft_model_updates_from_disk_and_tensors(draft_pair, tmp_path):
    target, draft = draft_pair
    core, control = _core(target, {"method": "draft_model", "model": draft, "num_speculative_tokens": K})
    target_before = _params(core.model)
    assert any(not torch.equal(a, b) for a, b in zip(_params(core.proposer.model).values(), target_before.values()))

    # From disk: the target's checkpoint becomes the draft; the target's weights do not move.
    updater = control._draft()
    data = control._draft_swap(updater, updater.read_checkpoint(target), complete=True)
    assert data["draft"]["weights"] == "updated" and data["num_draft_weights_updated"] > 0
    for name, value in load_file(f"{target}/model.safetensors").items():
        if core.proposer.model.resolve_weight(name) is not None:
            assert torch.equal(_hf_tensor(core.proposer.model, name), value), name
    assert all(torch.equal(v, target_before[n]) for n, v in _params(core.model).items())

    # From tensors (a subset, by HF names): exactly the file's tensor.
    name = "model.layers.0.mlp.down_proj.weight"
    new = torch.randn(load_file(f"{target}/model.safetensors")[name].shape)
    save_file({name: new}, tmp_path / "part.safetensors")
    control._draft_swap(updater, weights.read_safetensors_file(str(tmp_path / "part.safetensors")))
    assert torch.equal(_hf_tensor(core.proposer.model, name), new)

    # Bad updates: a 400 before anything is copied; the draft keeps what it had.
    kept = _params(core.proposer.model)
    for bad, needle in (([(name, torch.zeros(3, 3))], "bad weight|shape"),
                        ([("model.layers.9.nope.weight", new)], "unknown weight"),
                        ([(name, new.to(torch.int32))], "floating")):
        with pytest.raises(ControlError, match=needle) as err:
            control._draft_swap(updater, bad)
        assert err.value.status == 400
    assert all(torch.equal(v, kept[n]) for n, v in _params(core.proposer.model).items())
    with pytest.raises(ControlError, match="lacks"):  # from disk: every weight or none
        control._draft_swap(updater, [(name, new)], complete=True)


def test_eagle_head_updates_and_no_draft_is_a_400(draft_pair, tmp_path):
    target, _ = draft_pair
    core, control = _core(target, {"method": "ngram", "num_speculative_tokens": K})
    with pytest.raises(ControlError, match="no draft weights.*'ngram'") as err:
        control._draft()
    assert err.value.status == 400

    head_a = _head_dir(tmp_path / "a", core.model.config, seed=1)
    head_b = _head_dir(tmp_path / "b", core.model.config, seed=2)
    core, control = _core(target, {"method": "eagle", "model": str(head_a), "num_speculative_tokens": K})
    updater = control._draft()
    control._draft_swap(updater, updater.read_checkpoint(str(head_b)), complete=True)
    live, want = core.proposer.head.hf_weights(), read_weights(head_b, read_config(head_b))
    assert live.keys() == want.keys() and all(torch.equal(live[n], want[n]) for n in want)

    fc = torch.randn(live["fc.weight"].shape)
    control._draft_swap(updater, [("model.fc.weight", fc)])  # vLLM's "model." prefix is accepted
    assert torch.equal(core.proposer.head.hf_weights()["fc.weight"], fc)
    for bad, needle in (([("fc.weight", torch.zeros(2, 2))], "shape"), ([("lm_head.weight", fc)], "unknown weight")):
        with pytest.raises(ControlError, match=needle):
            control._draft_swap(updater, bad)
    assert torch.equal(core.proposer.head.hf_weights()["fc.weight"], fc)  # the old head keeps serving
    (tmp_path / "c").mkdir()
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    (tmp_path / "c" / "config.json").write_text(json.dumps({**config, "hidden_size": 8}))
    with pytest.raises(ControlError, match="cannot load EAGLE head"):
        updater.read_checkpoint(str(tmp_path / "c"))


def _run(core: ExecutorCore, scheduler, *, until=None) -> dict[str, list[int]]:
    """Step until done (or until `until(core)` holds); the tokens sampled per request."""
    out: dict[str, list[int]] = {}
    while scheduler.has_work():
        batch = scheduler.schedule()
        if batch is None:
            break
        result = core.execute(batch)
        for rid, token in zip(result.request_ids, result.sampled_token_ids.tolist()):
            if token >= 0:
                out.setdefault(rid, []).append(token)
                out[rid].extend(result.more_token_ids.get(rid, ()))
        scheduler.update_from_output(result)
        if until is not None and until(core):
            return out
    return out


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_a_target_update_flushes_the_proposer_state(draft_pair, tmp_path, method):
    target, draft = draft_pair
    if method == "eagle":  # an untrained head: it drafts (badly), which is all the flush needs
        draft = _head_dir(tmp_path / "head", load_model_config(target), seed=3)
    core, control = _core(target, {"method": method, "model": draft, "num_speculative_tokens": K})
    scheduler = build_scheduler(core.config)
    prompt = np.array([5, 9, 13, 2, 7, 11, 3, 8], np.int32)
    for rid, speculative in (("spec", True), ("plain", False)):
        scheduler.add_request(AddRequest(
            request_id=rid, prompt_token_ids=prompt, eos_token_ids=(2,), arrival_time=time.time(),
            sampling=SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, speculative=speculative)))

    def drafting(c) -> bool:
        state = c.requests.get("spec")
        return state is not None and state.depth is not None and state.depth.ema < 1 and (
            state.eagle_kv is not None if method == "eagle" else bool(c.proposer.seqs))

    first = _run(core, scheduler, until=drafting)
    assert drafting(core), "the speculative request never built proposer state"
    data = control._swap(weights.read_checkpoint(target, core.model), flush_cache=True, complete=True)
    assert data["draft"]["weights"] == "kept" and data["draft"]["method"] == method
    assert data["draft"]["num_requests_flushed"] >= 1
    state = core.requests["spec"]
    assert state.depth.ema == 1.0 and state.eagle_kv is None  # the acceptance history starts afresh
    if method == "draft_model":
        assert data["draft"]["num_draft_caches_flushed"] >= 1 and not core.proposer.seqs
    rest = _run(core, scheduler)
    tokens = {rid: first.get(rid, []) + rest.get(rid, []) for rid in ("spec", "plain")}
    # The same weights were loaded: greedy output is the non-speculative one, token for token.
    assert tokens["spec"][:24] == tokens["plain"][:24] and len(tokens["plain"]) == 24
