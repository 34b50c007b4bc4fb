"""Pooling models: embeddings, classification / reward scores, cross-encoder scores.

A pooling model (`--runner pooling`) answers a prompt with one vector instead
of generated tokens. Its requests run through the same scheduler as
generation: admitted, chunk-prefilled and prefix-cached like any prompt;
they ask for one "token" (max_tokens=1), and the executor's pooling head
(`actors/executor/pooler.py`) answers that step with the pooled hidden state
(embed) or the score head's logits (classify) instead of sampling. The
vector rides `BatchResult.pooled` -> `RequestDelta.pooled` ->
`RequestOutputDelta.pooled` to the api, which applies the per-request
parts (Matryoshka `dimensions`, normalization, softmax / sigmoid).

    config.py    PoolerConfig (--pooler-config, --convert), resolve_pooler
    outputs.py   per-request post-processing: dimensions, normalize, activation
    offline.py   LLM.embed / classify / score / reward
"""
