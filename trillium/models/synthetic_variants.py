"""The architectures `trillium build-model` writes (`--variant`): each one's config.json fields.

WHY a module of its own: the CLI lists them in `--help` and its parser is
built on every `trillium` command; `synthetic.py`, which writes the
checkpoints, imports torch (seconds), this imports nothing.
"""

from __future__ import annotations

from typing import Any

_VARIANTS: dict[str, dict[str, Any]] = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "llama-linear": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "rope_theta": None,  # transformers 5 keeps theta inside rope_parameters
        "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    },
    "llama-dynamic": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "rope_scaling": {"type": "dynamic", "factor": 2.0},
    },
    "llama-tied": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "tie_word_embeddings": True,
        "rope_theta": 500000.0,
    },
    "mistral": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "num_key_value_heads": 1,
        "sliding_window": None,
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "rms_norm_eps": 1e-6,
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "head_dim": 32,
        "attention_bias": False,
        "use_sliding_window": False,
        "rms_norm_eps": 1e-6,
    },
    "mistral-sliding": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "sliding_window": 24,
    },
    "phi3": {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "sliding_window": 32,
        "rms_norm_eps": 1e-5,
    },
    "qwen2-moe": {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 96,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "use_sliding_window": False,
        "rms_norm_eps": 1e-6,
    },
    "qwen3-moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
        "attention_bias": False,
        "use_sliding_window": False,
        "rms_norm_eps": 1e-6,
    },
    "mixtral": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 48,
        "sliding_window": None,
    },
    "gemma2": {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 24,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "sliding_window": 16,
        # NOTE: untied: a tied random Gemma echoes its last input token (the
        # sqrt(hidden)-scaled embedding dominates the residual), so greedy tests would be vacuous.
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
    },
    "gemma3": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "num_hidden_layers": 3,
        "head_dim": 32,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 32,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "rope_theta": None,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
        },
        # NOTE: untied: a tied random Gemma echoes its last input token (the
        # sqrt(hidden)-scaled embedding dominates the residual), so greedy tests would be vacuous.
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
    },
    # Pooling checkpoints (trillium/models/pooling_model.py): a three-label classifier, a
    # one-label reward model / cross-encoder, and a bare Qwen3Model backbone saved with
    # transformers' prefix-less names (as Qwen3-Embedding ships), Matryoshka-trained per config.
    "llama-classify": {
        "architectures": ["LlamaForSequenceClassification"],
        "model_type": "llama",
        "id2label": {"0": "negative", "1": "neutral", "2": "positive"},
        "label2id": {"negative": 0, "neutral": 1, "positive": 2},
    },
    "qwen3-reward": {
        "architectures": ["Qwen3ForSequenceClassification"],
        "model_type": "qwen3",
        "head_dim": 32,
        "attention_bias": False,
        "use_sliding_window": False,
        "rms_norm_eps": 1e-6,
        "id2label": {"0": "LABEL_0"},
        "label2id": {"LABEL_0": 0},
    },
    "mistral-classify": {
        "architectures": ["MistralForSequenceClassification"],
        "model_type": "mistral",
        "num_key_value_heads": 1,
        "sliding_window": None,
        "id2label": {"0": "LABEL_0", "1": "LABEL_1"},
        "label2id": {"LABEL_0": 0, "LABEL_1": 1},
    },
    "qwen3-embed": {
        "architectures": ["Qwen3Model"],
        "model_type": "qwen3",
        "head_dim": 32,
        "attention_bias": False,
        "use_sliding_window": False,
        "rms_norm_eps": 1e-6,
        "matryoshka_dimensions": [16, 32, 64],
    },
    # Benchmark pooling checkpoints: the bench backbone as an embedder and as a cross-encoder.
    "bench-embed": {
        "architectures": ["LlamaModel"],
        "model_type": "llama",
        "vocab_size": 8192,
        "hidden_size": 512,
        "intermediate_size": 1376,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "max_position_embeddings": 4096,
    },
    "bench-rerank": {
        "architectures": ["LlamaForSequenceClassification"],
        "model_type": "llama",
        "vocab_size": 8192,
        "hidden_size": 512,
        "intermediate_size": 1376,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "max_position_embeddings": 4096,
        "id2label": {"0": "LABEL_0"},
        "label2id": {"LABEL_0": 0},
    },
    "bench": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 8192,
        "hidden_size": 512,
        "intermediate_size": 1376,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "max_position_embeddings": 4096,
    },
}
VARIANTS = tuple(_VARIANTS)
# No LM head: tested against transformers' *ForSequenceClassification / AutoModel instead.
POOLING_VARIANTS = ("llama-classify", "qwen3-reward", "mistral-classify", "qwen3-embed", "bench-embed", "bench-rerank")
