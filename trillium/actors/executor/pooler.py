"""The executor's pooling head: pooled outputs where a generator would sample.

Built by `ExecutorCore` when the engine runs a pooling model (`--runner
pooling`; `PoolingHead.build` returns None otherwise). A pooling request is
a prompt with max_tokens=1: when its scheduled tokens reach the end of the
prompt (the step that would sample), `finish` answers with its pooled
output and the placeholder token `POOLED_TOKEN_ID`, which ends the request
through max_tokens in the scheduler: the scheduler has no pooling branch.

    observe(hidden, states, counts)   every step: MEAN / CLS / ALL / STEP keep what
                                      later chunks cannot recompute
    finish(hidden, rows, states)      -> float32 [N, output_size]: LAST takes
                                      the request's last row, MEAN the mean of
                                      every prompt row, CLS the first; then the
                                      model's `pool_head` (score head, or none)
    result_fields(hidden, rows, states) -> BatchResult's pooled fields; for ALL /
                                      STEP one row per prompt token (STEP: the
                                      rows of step_tag_id, the returned_token_ids
                                      columns), rows of request i at
                                      pooled_row_offsets[i]:[i + 1]
    drop(request_ids)                 finished / aborted requests

Per request: its task (`SamplingParams.pooling_task`, None: the server's
default) picks sequence pooling (the server's LAST / MEAN / CLS; LAST under
ALL / STEP) or token pooling (STEP when the server pools STEP, else ALL);
one batch may mix them. State: per request a running float32 sum (MEAN),
the first row (CLS) or every chunk's rows (token tasks), across
chunked-prefill steps. A token task never reads the prefix cache
(scheduler/request.py `reads_prefix_cache`, as vLLM). NOTE: all but LAST need every prompt row
computed here, so `EngineConfig.resolve` turns prefix caching off for them
(a cached block's rows never reach the executor); LAST keeps it (the last
prompt token is always computed). A recompute preemption restarts at
position 0 and resets the state; a swapped-in request continues it.
"""

from __future__ import annotations

import numpy as np
import torch

from trillium.pooling.config import PoolerConfig

# The "token" a finished pooling request reports (the scheduler appends it; nobody decodes it).
POOLED_TOKEN_ID = 0


class PoolingHead:
    def __init__(self, config: PoolerConfig, model) -> None:
        self.pooling_type = config.sequence_pooling_type  # of sequence tasks (embed, classify)
        self.model = model
        self._sums: dict[str, torch.Tensor] = {}
        self._first: dict[str, torch.Tensor] = {}
        self._chunks: dict[str, list[torch.Tensor]] = {}  # token tasks: each step's rows
        self.is_token_pooling = config.is_token_pooling  # the default of a request that names no task
        # STEP's filters apply to token tasks when the server pools STEP (else: ALL, every row).
        step = config.token_pooling_type == "STEP"
        self.step_tag_id = config.step_tag_id if step else None
        self.returned_token_ids = config.returned_token_ids if step else None

    @staticmethod
    def build(engine_config, model) -> "PoolingHead | None":
        if engine_config.runner != "pooling":
            return None
        return PoolingHead(PoolerConfig.from_json(engine_config.pooler_config), model)

    def per_token(self, state) -> bool:
        """Whether this request asked for a token task (its SamplingParams.pooling_task)."""
        task = state.sampling.params.pooling_task
        return self.is_token_pooling if task is None else task.startswith("token_")

    def observe(self, hidden: torch.Tensor, states, counts: list[int]) -> None:
        row = 0
        for state, n in zip(states, counts):
            begin, rid = state.num_computed_tokens, state.request_id
            chunk = hidden[row : row + n]
            row += n
            if self.per_token(state):
                kept = [] if begin == 0 else self._chunks[rid]
                kept.append(chunk.clone())  # NOTE: only prompt rows; a pooling request decodes none
                self._chunks[rid] = kept
            elif self.pooling_type == "CLS":
                if begin == 0:
                    self._first[rid] = chunk[0].clone()
            elif self.pooling_type == "MEAN":
                total = chunk.float().sum(dim=0)
                self._sums[rid] = total if begin == 0 else self._sums[rid] + total

    def finish(self, hidden: torch.Tensor, rows: list[int], states) -> np.ndarray:
        """Sequence tasks: one pooled output row per request."""
        if self.pooling_type == "LAST":
            pooled = hidden.index_select(0, torch.tensor(rows, dtype=torch.int64, device=hidden.device))
        elif self.pooling_type == "CLS":
            pooled = torch.stack([self._first.pop(s.request_id) for s in states])
        else:
            means = [self._sums.pop(s.request_id) / s.num_prompt_tokens for s in states]
            pooled = torch.stack(means).to(hidden.dtype)
        return self.model.pool_head(pooled).cpu().numpy()

    def result_fields(self, hidden: torch.Tensor, rows: list[int], states) -> dict:
        """BatchResult's `pooled` of finished prompts; with any token task among them, every
        request's rows at `pooled_row_offsets` (a sequence task's one row)."""
        token = [self.per_token(s) for s in states]
        if not any(token):
            return {"pooled": self.finish(hidden, rows, states)}
        seq = [(r, s) for r, s, t in zip(rows, states, token) if not t]
        seq_out = iter(self.finish(hidden, [r for r, _ in seq], [s for _, s in seq]) if seq else ())
        outputs = [self._token_rows(s) if t else next(seq_out)[None] for s, t in zip(states, token)]
        offsets = np.zeros(len(outputs) + 1, np.int64)
        np.cumsum([len(o) for o in outputs], out=offsets[1:])
        return {"pooled": np.concatenate(outputs), "pooled_row_offsets": offsets}

    def _token_rows(self, state) -> np.ndarray:
        out = self.model.pool_head(torch.cat(self._chunks.pop(state.request_id)))  # [num_prompt_tokens, width]
        if self.returned_token_ids is not None:
            out = out[:, list(self.returned_token_ids)]
        if self.step_tag_id is not None:
            prompt = torch.tensor(state.token_ids[: state.num_prompt_tokens], device=out.device)
            out = out[prompt == self.step_tag_id]
        return out.cpu().numpy()

    def drop(self, request_ids) -> None:
        for rid in request_ids:
            self._sums.pop(rid, None)
            self._first.pop(rid, None)
            self._chunks.pop(rid, None)
