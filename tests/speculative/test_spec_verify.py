"""Speculative decoding, unit level: the ngram proposer, the config, and exact verification.

The statistical tests drive `verify_drafts` with synthetic logits: many
independent trials at a fixed prefix, token frequencies against the
target's own distribution (the sampler's `process_logits` + `target_probs`),
a chi-square goodness-of-fit test; the same test run with a wrong acceptance
rule must fail. Mirrors the rejection rule of vLLM's
vllm/v1/sample/rejection_sampler.py (point-mass drafts: accept with p(x),
resample from p with x removed); the proposer mirrors
vllm/v1/spec_decode/ngram_proposer.py (longest suffix n-gram, earliest
occurrence) and the config vllm/config/speculative.py (prompt_lookup defaults).
"""

from __future__ import annotations

import pytest
import torch

from trillium.actors.executor.sampler import SamplingState, process_logits, target_probs
from trillium.sampling_params import SamplingParams
from trillium.speculative.config import parse_speculative_config
from trillium.speculative.proposer import AdaptiveDepth, DraftCosts, NgramProposer
from trillium.speculative.scheduling import DraftBudget
from trillium.speculative.verify import DraftRun, verify_drafts

V = 8
TRIALS = 2000


@pytest.fixture(autouse=True)
def _fixed_draws():
    """WHY: the unseeded rows draw from torch's default generator; a fixed seed makes
    each statistical test's verdict reproducible."""
    torch.manual_seed(1234)


def test_ngram_proposer_matches_vllm_examples():
    proposer = NgramProposer(2, 3)
    # vLLM's docstring example: [4,2,3] has no earlier match, [2,3] does: what followed it.
    assert proposer.propose([1, 2, 3, 4, 2, 3], 4) == [4, 2, 3]
    assert proposer.propose([1, 2, 3, 4, 2, 3], 2) == [4, 2]
    assert proposer.propose([1, 2, 3, 4, 5], 4) == []  # no repeated suffix
    # The longest n-gram wins over a shorter one's earlier occurrence.
    assert NgramProposer(1, 3).propose([7, 9, 1, 2, 3, 8, 3, 1, 2, 3], 2) == [8, 3]
    assert NgramProposer(1, 1).propose([5, 6, 5, 7, 5], 3) == [6, 5, 7]  # earliest occurrence


def test_config_parsing_and_errors():
    cfg = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (5, 5)
    cfg = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (2, 4, 4)
    assert not parse_speculative_config(None).enabled
    assert cfg.disable_by_batch_size == 0  # absent: never off
    for given, stored in ((4, 4), (None, 0)):
        assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                         "disable_by_batch_size": given}).disable_by_batch_size == stored
    for bad in (True, 0, 1, -1, "2", 1.5):  # vLLM too refuses below 2
        with pytest.raises(ValueError, match="disable_by_batch_size"):
            parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": bad})
    for bad, words in (({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1},
                        "draft_tensor_parallel_size"),
                       ({"method": "eagle", "num_speculative_tokens": 2}, "eagle"),
                       ({"method": "nope", "num_speculative_tokens": 2}, "nope"),
                       ({"method": "ngram"}, "num_speculative_tokens"),
                       ({"method": "ngram", "num_speculative_tokens": "3"}, "integer"),
                       ("{not json", "JSON")):
        with pytest.raises(ValueError, match=words):
            parse_speculative_config(bad)


def test_draft_budget_bounds_and_counters():
    budget = DraftBudget(4)
    assert budget.num_to_verify(4, 100, 0, 100, 10, 1000) == 4
    assert budget.num_to_verify(4, 3, 0, 100, 10, 1000) == 2  # the step's budget: 1 + 2
    assert budget.num_to_verify(4, 100, 97, 100, 10, 1000) == 2  # max_tokens: 3 tokens left
    assert budget.num_to_verify(4, 100, 0, 100, 998, 1000) == 1  # max_model_len
    budget.verified(4, 2)
    budget.verified(3, 0)
    budget.verified(0, 0)  # no drafts: not a draft
    stats = budget.stats()
    assert stats["spec_decode_num_drafts_total"] == 2
    assert stats["spec_decode_num_draft_tokens_total"] == 7
    assert stats["spec_decode_num_accepted_tokens_total"] == 2
    assert stats["spec_decode_num_accepted_tokens_per_pos_total"] == (1, 1, 0, 0)
    # disable_by_batch_size 2: a step planned with 3 running verifies none, with 2 it does.
    budget = DraftBudget(4, disable_by_batch_size=2)
    budget.begin_step(3)
    assert budget.num_to_verify(4, 100, 0, 100, 10, 1000) == 0 and not budget.proposes_next(3)
    budget.begin_step(2)
    assert budget.num_to_verify(4, 100, 0, 100, 10, 1000) == 4 and budget.proposes_next(2)
    assert budget.stats()["spec_decode_num_steps_disabled_by_batch_size_total"] == 1
    never = DraftBudget(4)  # disable_by_batch_size 0: never off
    never.begin_step(1000)
    assert never.num_to_verify(4, 100, 0, 100, 10, 1000) == 4 and never.proposes_next(1000)


def test_adaptive_depth_goes_down_when_drafts_fail_and_probes_back():
    depth = AdaptiveDepth(4)
    assert depth.next_depth() == 4  # acceptance starts at 1
    for _ in range(3):
        depth.observe(4, 0)  # one position tried a step, none passed
    assert round(depth.ema, 3) == 0.343
    assert depth.next_depth(0.1) == 1  # (1 + .343) / 1.1 beats none and (1 + .343 + .118) / 1.2
    for _ in range(3):
        depth.observe(1, 0)
    assert depth.ema < 0.15
    assert [depth.next_depth(0.2) for _ in range(8)] == [0] * 7 + [1]  # stopped: a probe every 8th step
    for _ in range(10):
        depth.observe(1, 1)
    assert depth.next_depth(0.2) == 4


def test_adaptive_depth_counts_positions_tried_and_weighs_the_measured_cost():
    depth = AdaptiveDepth(4)
    depth.observe(4, 2)  # positions 1, 2 passed, 3 failed: 2 of 3 tried
    assert depth.ema == 0.7 * 1.0 + 0.3 * (2 / 3)
    depth.observe(2, 2)  # every draft passed: 2 of 2
    assert depth.ema == 0.7 * (0.7 + 0.3 * 2 / 3) + 0.3
    at_40 = AdaptiveDepth(4)
    at_40.ema = 0.4
    # cheap drafts (a float target: verify rows ride on the weights' reads) keep drafting deeper
    # at 40 % than costly ones (packed weights on a CPU: every row costs arithmetic), which draft one
    assert at_40.next_depth(0.03) == 3 and at_40.next_depth(0.1) == 2 and at_40.next_depth(0.45) == 1
    at_10 = AdaptiveDepth(4)
    at_10.ema = 0.1
    assert at_10.next_depth(0.05) == 1 and at_10.next_depth(0.2) == 0  # below 0.15 only a paying depth drafts


def test_draft_costs_measure_a_draft_against_a_plain_decode_step():
    costs = DraftCosts()
    assert costs.relative() == 0.1  # before any measurement
    costs.observe_step(0.050, 0)  # a decode step without drafts: 50 ms
    costs.observe_step(0.056, 3)  # 3 draft rows added 6 ms: 2 ms a row
    costs.observe_proposal(0.004, 2)  # 2 positions drafted in 4 ms
    assert abs(costs.relative() - (0.002 + 0.002) / 0.050) < 1e-12
    costs.observe_step(0.060, 0)  # moving averages, weight 0.1
    assert abs(costs.step_s - 0.051) < 1e-12


def _state(seed=None, **params) -> SamplingState:
    return SamplingState(SamplingParams(seed=seed, **params), [1, 2], vocab_size=V)


def _logits(seed: int) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 1.5


def _target(logits: torch.Tensor, state: SamplingState) -> torch.Tensor:
    """The distribution the plain sampler draws from for this state."""
    row = logits.clone().unsqueeze(0)
    process_logits(row, [state])
    return target_probs(row, [state])[0]


def _run_trials(params: dict, drafts: list[int], accept=None, trials: int = TRIALS):
    """`trials` independent verifications at a fixed prefix; (runs, per-position logits)."""
    positions = [_logits(10 + j) for j in range(len(drafts) + 1)]
    runs = [DraftRun(_state(**params), list(drafts), i * (len(drafts) + 1)) for i in range(trials)]
    logits = torch.stack([positions[j] for _ in range(trials) for j in range(len(drafts) + 1)])
    if accept is None:
        verify_drafts(logits, runs)
    else:
        verify_drafts(logits, runs, accept=accept)
    return runs, positions


def _chi2_pvalue(tokens: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=V).double()
    expected = probs.double() * len(tokens)
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token outside the target's support was emitted"
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


# One likely draft and one unlikely: both the accept and the residual paths carry mass.
@pytest.mark.parametrize("params", [
    {"temperature": 1.0},
    {"temperature": 0.7, "top_k": 5, "top_p": 0.9},
    {"temperature": 1.0, "min_p": 0.05, "frequency_penalty": 1.5, "presence_penalty": 0.5},
])
def test_first_token_has_the_target_distribution(params):
    probs = _target(_logits(10), _state(**params))
    likely = int(probs.argmax())
    runs, _ = _run_trials(params, [likely, 3])
    assert _chi2_pvalue([r.tokens[0] for r in runs], probs) > 1e-3
    assert 0 < sum(r.num_accepted for r in runs) < 2 * TRIALS


def test_second_token_is_conditioned_on_the_accepted_prefix():
    """With penalties the second position's distribution depends on the first token:
    given the draft was accepted, the second token follows the target with it counted."""
    params = {"temperature": 1.0, "frequency_penalty": 2.0}
    first = int(_target(_logits(10), _state(**params)).argmax())
    second_draft = 5
    runs, positions = _run_trials(params, [first, second_draft])
    after = [r.tokens[1] for r in runs if r.tokens[0] == first]
    assert len(after) > 200
    state = _state(**params)
    state.append(first)
    assert _chi2_pvalue(after, _target(positions[1], state)) > 1e-3


def test_wrong_acceptance_rule_fails_the_test():
    """The same check catches a broken verifier: accepting with sqrt(p(x)) over-emits the draft."""
    params = {"temperature": 1.0}
    probs = _target(_logits(10), _state(**params))
    draft = int(probs.argsort()[V // 2])  # a middling token: sqrt(p) >> p
    runs, _ = _run_trials(params, [draft], accept=lambda p_x, u: u < p_x.sqrt())
    assert _chi2_pvalue([r.tokens[0] for r in runs], probs) < 1e-6
    exact, _ = _run_trials(params, [draft])
    assert _chi2_pvalue([r.tokens[0] for r in exact], probs) > 1e-3


def test_greedy_accepts_iff_argmax_and_stops_at_eos():
    logits = torch.stack([_logits(10 + j) for j in range(4)])
    best = logits.argmax(-1).tolist()
    run = DraftRun(_state(temperature=0.0), [best[0], best[1], (best[2] + 1) % V], 0)
    verify_drafts(logits, [run])
    assert run.tokens == best[:3] and run.num_accepted == 2
    stop = DraftRun(_state(temperature=0.0), [best[0], best[1], best[2]], 0, stop_ids=frozenset({best[1]}))
    verify_drafts(logits, [stop])
    assert stop.tokens == best[:2] and stop.num_accepted == 2  # the run ends after a stop token


def test_unprocessed_greedy_runs_take_one_argmax_with_the_loops_tokens(monkeypatch):
    """Greedy runs nothing processes are verified all at once (verify._verify_greedy); the
    tokens, acceptances and appended state equal the per-position loop's, in a step with a
    penalised greedy run and a sampled run (which keep the loop)."""
    from trillium.speculative import verify

    logits = torch.stack([_logits(30 + j) for j in range(12)])
    best = logits.argmax(-1).tolist()

    def runs():
        return [DraftRun(_state(temperature=0.0), [best[0], best[1], (best[2] + 1) % V], 0),
                DraftRun(_state(temperature=0.0), best[4:7], 4, stop_ids=frozenset({best[5]})),
                DraftRun(_state(temperature=0.0, repetition_penalty=1.5), best[8:10], 8),
                DraftRun(_state(temperature=0.0, max_tokens=8), [], 11)]

    fast = runs()
    verify_drafts(logits, fast)
    assert verify._unprocessed_greedy(runs()[0]) and not verify._unprocessed_greedy(runs()[2])
    monkeypatch.setattr(verify, "_unprocessed_greedy", lambda run: False)
    slow = runs()
    verify_drafts(logits, slow)
    for a, b in zip(fast, slow):
        assert (a.tokens, a.num_accepted, a.state.output_token_ids) == (b.tokens, b.num_accepted, b.state.output_token_ids)
    assert fast[0].tokens == best[:3] and fast[0].num_accepted == 2
    assert fast[1].tokens == best[4:6] and fast[3].tokens == [best[11]]


def test_seeded_runs_repeat():
    params = {"temperature": 1.0, "seed": 42}
    a, _ = _run_trials(params, [0, 1, 2], trials=100)
    b, _ = _run_trials(params, [0, 1, 2], trials=100)
    assert [r.tokens for r in a] == [r.tokens for r in b]


def test_serve_flag_reaches_the_config_and_bad_keys_stop_start_up(tmp_path):
    from trillium.cli import _serve_engine_config, build_parser

    def parse(value: str):
        args = build_parser().parse_args(["serve", str(tmp_path), "--speculative-config", value])
        return _serve_engine_config(args, str(tmp_path), ())

    good = parse('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}')
    assert (good.speculative_config.num_speculative_tokens, good.speculative_config.prompt_lookup_max) == (2, 2)
    with pytest.raises(SystemExit, match="bogus"):
        parse('{"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}')


def test_tensor_parallel_with_speculation_is_a_start_up_error():
    from trillium.config import EngineConfig

    with pytest.raises(ValueError, match="tensor-parallel-size"):
        EngineConfig.build(model="m", tensor_parallel_size=2,
                           speculative_config={"method": "ngram", "num_speculative_tokens": 2})
