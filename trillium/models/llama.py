"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3) over the paged KV cache.

Input is one flat varlen batch (see `trillium.kernels.metadata`): T tokens
of B sequences back to back, their positions, and per layer a `KvCache`
(`kv_cache.py`: k_cache, v_cache [num_blocks, block_size, KH, D], and the
per-tensor scales of an fp8 cache). Each layer
writes the new tokens' keys/values into the cache first, then attends over
the cache, so prefill, chunked prefill with context and decode are one path.

    forward(input_ids [T], positions [T], kv_caches, meta, lora=None) -> hidden [T, hidden]
    compute_logits(hidden [N, hidden]) -> logits [N, vocab] float32

Parameters are fused for speed: q/k/v are one `qkv_proj` (rows [q | k | v])
and gate/up one `gate_up_proj` (rows [gate | up]). `load_weights` takes HF
names (`...q_proj.weight`) and copies each into its slice, so the same
method serves the loader and live weight updates (RLHF).

Multi-LoRA: with a `trillium.lora.LoRABatch`, each layer adds the adapters'
low-rank deltas after every fused projection (qkv, o, gate_up, down), per
output slice; without one (the default) the forward does no LoRA work.

Sliding windows (Mistral, Phi-3, Qwen's `use_sliding_window`) are masked
in the attention kernel, per layer (`ModelConfig.layer_window`). NOTE: the
KV blocks behind a window stay allocated (the scheduler frees nothing early).

Other families subclass `LlamaForCausalLM` at its seams: `make_layer`
(the decoder layer of index i), `embed`, `rope_table`, `compute_logits`
and the weight-name hooks `_resolve` / `checkpoint_weight_names`
(`moe.py`: Qwen2-MoE, Qwen3-MoE, Mixtral; `gemma.py`: Gemma 2 / 3;
`registry.py` picks the class for an architecture).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from trillium import kernels
from trillium.kernels import AttentionMetadata, dense_cpu, native_ops, onednn_packed, padded_rows, panel_cpu
from trillium.models.config import ModelConfig, torch_dtype
from trillium.models.kv_cache import KvCache, allocate_kv_caches, kv_cache_block_bytes  # noqa: F401 (re-exported)
from trillium.models.rope import build_cos_sin_cache, default_num_positions

if TYPE_CHECKING:  # WHY: trillium.lora imports trillium.models.config; avoid the cycle at run time
    from trillium.lora import LayerLoRA, LoRABatch

# HF module suffix -> (fused module suffix, shard name)
_STACKED_PARAMS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "mlp.gate_proj": ("mlp.gate_up_proj", "gate"),
    "mlp.up_proj": ("mlp.gate_up_proj", "up"),
}
# Buffers some older checkpoints carry; recomputed here.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# WHY oneDNN: ATen sends float32 F.linear to MKL's sgemm, which on the
# 2-core AMD EPYC machine we benchmark on runs 2-2.5x slower than oneDNN's
# matmul on the same plain weights (K 512: 537 -> 266 us at 32 rows, 75 -> 53
# us at 1, 15.3 -> 6.9 ms at 1024; decode step of the bench model 35 -> 22 ms).
# Same math, different blocking: outputs differ from F.linear by ~1e-6
# relative, so greedy tokens can flip where the top two logits are within
# ~1e-5. oneDNN multiplies a copy of each weight packed once into its blocked
# layout (kernels/onednn_packed.py: the reorder of the plain weight on every
# call cost 1.04-1.76x at 16-2048 rows; whatever changes weights calls its forget()).
# Inference only (no autograd).
# Making this False puts every call of more than dense_cpu.MAX_ROWS rows that panel_cpu does not take
# back on F.linear.
_ONEDNN = onednn_packed.available


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; float32 CPU inference runs `_cpu_linear` (a few rows: dense_cpu's kernel; more:
    panel_cpu's on a Zen 4-class CPU, else oneDNN)."""
    if (
        x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.numel() > 0
        and not torch.is_grad_enabled()
        and (_ONEDNN or dense_cpu.available())
    ):
        if torch.compiler.is_compiling():
            if native_ops.loaded() and dense_cpu.fits(x, weight, bias):  # decode rows: dense_cpu.c from C++
                return torch.ops.trillium_native.cpu_linear(x, weight, bias)
            return torch.ops.trillium.cpu_linear(x, weight, bias)
        return _cpu_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """float32 CPU inference. WHY more than one kernel: up to dense_cpu.MAX_ROWS rows (decode and verify steps)
    the product is bound by reading the weights, which dense_cpu.c streams ~1.5x faster than oneDNN's
    small-M path (the bench model's 33 linears of a batch-1 decode step: 8.8 against 12.0 ms, bench/dense_linear.py);
    its 512-bit tiles (Intel AVX-512), and its 256-bit ones on AVX2 without AVX-512, stay ahead up to
    64 rows (1.05-1.07x there; dense_cpu.MAX_ROWS). With more rows each weight is reused: on an
    AVX-512F CPU that is not Intel's panel_cpu.c's kernel on panel-packed weights takes them
    (1.16-1.3x oneDNN's packed matmul at 17-64 rows on a Zen 4, level past ~128 alone, 1.10x on the
    all64 workload served), elsewhere oneDNN's blocked matmul. Inside a compiled decode
    graph only the live rows are computed (kernels/padded_rows.py: a 5-token verify step in the
    8-row graph pays 5 rows), the padding rows are zeros."""
    return padded_rows.skip_padding(x, weight.shape[0], lambda live: _cpu_linear_rows(live, weight, bias))


def _cpu_linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if dense_cpu.takes(x, weight, bias):
        return dense_cpu.linear(x, weight, bias)
    if panel_cpu.takes(x, weight, bias):  # past dense_cpu's rows on a Zen 4-class CPU (kernels/panel_cpu.py)
        return panel_cpu.linear(x, weight, bias)
    if not _ONEDNN:
        return F.linear(x, weight, bias)
    return onednn_packed.linear(x, weight, bias)


# WHY an op of our own: Inductor's lowering of mkldnn._linear_pointwise expects
# weights it packed itself (freezing), and F.linear in a graph becomes MKL's
# sgemm again (see _ONEDNN). Opaque to the compiler, the same kernels as
# eager (`_cpu_linear`), reading the live weights (or oneDNN's or the panel kernel's packed copy of
# them, dropped wherever weights change: kernels/onednn_packed.py).
# NOTE: torch.library.Library, not @custom_op: the latter wraps every call in
# Python autograd and dynamo-disable layers (and imports torch._dynamo on the
# first call); this op runs 4 times per layer per step.
_LIB = torch.library.Library("trillium", "FRAGMENT")
_LIB.define("cpu_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIB.impl("cpu_linear", _cpu_linear, "CPU")


@torch.library.register_fake("trillium::cpu_linear")
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class Linear(nn.Linear):
    """nn.Linear (same parameters and loading) whose forward is `linear`.

    `partial` / `reduce` split the forward at the point where a row-parallel
    layer (`tensor_parallel.RowParallelLinear`) sums the ranks' products:
    here `reduce` is the identity.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def reduce(self, out: torch.Tensor) -> torch.Tensor:
        return out


def project_with_lora(module: nn.Module, projection: str, x: torch.Tensor, lora: LayerLoRA) -> torch.Tensor:
    """module(x) plus the LoRA delta of `projection`.

    WHY the delta joins before `reduce`: under tensor parallelism a
    row-parallel layer's output on each rank is a partial sum; the adapter's
    A is sharded on the input dim like the weight (lora/tensor_parallel.py),
    so its delta is a partial sum too and the layer's one all-reduce adds both
    (vLLM's RowParallelLinearWithLoRA applies base + LoRA, then all-reduces).
    Packed GGUF layers split forward the same way (packed_linear.GgufLinear); int4 layers never
    run sharded: plain forward, then the delta.
    """
    if hasattr(module, "partial"):
        out = module.partial(x)
        lora.apply(projection, x, out)
        return module.reduce(out)
    out = module(x)
    lora.apply(projection, x, out)
    return out


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, **factory: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, **factory))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int = 0, norm: type[nn.Module] = RMSNorm, **factory: Any) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        gemma = config.gemma
        self.scale = (gemma.query_pre_attn_scalar if gemma else config.head_dim) ** -0.5
        self.softcap = gemma.attn_logit_softcapping if gemma else None
        self.sliding_window = config.layer_window(layer)
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias, **factory
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.attention_out_bias, **factory)
        self.q_norm = norm(config.head_dim, config.rms_norm_eps, **factory) if config.qk_norm else None
        self.k_norm = norm(config.head_dim, config.rms_norm_eps, **factory) if config.qk_norm else None

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: KvCache,
        meta: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
        lora: LayerLoRA | None = None,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if lora is not None:
            lora.apply("qkv_proj", x, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # NOTE: views of the fused output: last dim contiguous, rows strided.
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = kernels.rotary_embedding(positions, q, k, cos_sin_cache)
        # NOTE: a compiled decode graph passes a GraphKvSlot here (graph_attention.py), same `attend`.
        out = kv_cache.attend(q, k, v, meta, self.scale, sliding_window=self.sliding_window, softcap=self.softcap)
        out = out.reshape(num_tokens, self.q_size)
        if lora is None:
            return self.o_proj(out)
        return project_with_lora(self.o_proj, "o_proj", out, lora)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[gate | up] -> gelu_tanh(gate) * up (Gemma's gelu_pytorch_tanh)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class MLP(nn.Module):
    def __init__(
        self, config: ModelConfig, intermediate_size: int | None = None, act_and_mul=None, **factory: Any
    ) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, intermediate_size or config.intermediate_size
        self.gate_up_proj = Linear(hidden, 2 * inter, bias=config.mlp_bias, **factory)
        self.down_proj = Linear(inter, hidden, bias=config.mlp_bias, **factory)
        self.act_and_mul = act_and_mul or kernels.silu_and_mul

    def forward(self, x: torch.Tensor, lora: LayerLoRA | None = None) -> torch.Tensor:
        if lora is None:
            return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))
        gate_up = self.gate_up_proj(x)
        lora.apply("gate_up_proj", x, gate_up)
        return project_with_lora(self.down_proj, "down_proj", self.act_and_mul(gate_up), lora)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int = 0, mlp: nn.Module | None = None, **factory: Any) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.self_attn = Attention(config, layer, **factory)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.mlp = mlp if mlp is not None else MLP(config, **factory)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: KvCache,
        meta: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
        lora: LayerLoRA | None = None,
    ) -> torch.Tensor:
        # Same residual order as HF, so float32 results agree to rounding.
        attn = self.self_attn(positions, self.input_layernorm(hidden), kv_cache, meta, cos_sin_cache, lora)
        hidden = hidden + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden), lora)


def _embedding(num_embeddings: int, dim: int, factory: dict[str, Any]) -> nn.Embedding:
    """nn.Embedding, left uninitialized where it is built on the meta device (`empty()` below).

    WHY: nn.Embedding's normal_ init on a meta tensor runs torch._refs.normal_, whose first call
    imports torch._dynamo: seconds of an eager executor's start-up (2 CPUs), for values never kept.
    """
    if torch.empty(0, device=factory.get("device")).device.type != "meta":
        return nn.Embedding(num_embeddings, dim, **factory)
    weight = torch.empty(num_embeddings, dim, **factory)
    return nn.Embedding(num_embeddings, dim, _weight=weight)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, make_layer, norm: type[nn.Module] = RMSNorm, **factory: Any) -> None:
        super().__init__()
        self.embed_tokens = _embedding(config.vocab_size, config.hidden_size, factory)
        self.layers = nn.ModuleList(make_layer(config, i, factory) for i in range(config.num_layers))
        self.norm = norm(config.hidden_size, config.rms_norm_eps, **factory)


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head; weights in `dtype`, rope table in float32."""

    norm_class: type[nn.Module] = RMSNorm  # the final norm's (Gemma: (1 + w))

    @staticmethod
    def make_layer(config: ModelConfig, index: int, factory: dict[str, Any]) -> nn.Module:
        """Decoder layer `index`; subclasses build their family's."""
        return DecoderLayer(config, index, **factory)

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        max_positions: int | None = None,
        tp=None,
    ) -> None:
        super().__init__()
        from trillium.models.tensor_parallel import TpShard  # WHY here: it imports this module

        self.config = config
        # Tensor parallelism (tensor_parallel.py): this rank's heads, MLP width and vocab rows.
        self.tp = tp if tp is not None else TpShard.whole(config)
        self.local_config = local = self.tp.local_config
        factory = {"dtype": torch_dtype(dtype or config.dtype), "device": device}
        self.model = LlamaModel(local, self.make_layer, self.norm_class, **factory)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, local.vocab_size, bias=False, **factory)
        )
        self.tp.parallelize(self)
        self.max_positions = max_positions or default_num_positions(config)
        cache = torch.empty(self.max_positions, config.head_dim, dtype=torch.float32, device=device)
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        if cache.device.type != "meta":
            self.reset_rope_cache()

    @classmethod
    def empty(
        cls,
        config: ModelConfig,
        *,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str = "cpu",
        max_positions: int | None = None,
        tp=None,
    ) -> "LlamaForCausalLM":
        """A model with uninitialized weights (fill with `load_weights`) and a valid rope table.

        WHY: default nn.Linear init costs seconds on a 7B model and is overwritten anyway.
        """
        with torch.device("meta"):
            model = cls(config, dtype=dtype, max_positions=max_positions, **({"tp": tp} if tp is not None else {}))
        # NOTE: Module.to_empty's empty_like of a meta tensor runs torch._refs, whose first call imports
        # sympy (a second of start-up); plain torch.empty gives the same contiguous storage.
        model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
        model.reset_rope_cache()
        return model

    def reset_rope_cache(self) -> None:
        table = build_cos_sin_cache(self.config, self.max_positions, device=self.cos_sin_cache.device)
        with torch.no_grad():
            self.cos_sin_cache.copy_(table)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def lm_head_weight(self) -> torch.Tensor:
        # NOTE: a tied head kept packed (packed_linear.py) is still the float embedding here.
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KvCache],
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states [T, hidden] for the flat batch.

        `lora` (optional) says which adapter slot each token uses; it must
        cover exactly the T tokens of `input_ids`.
        """
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"need {len(self.model.layers)} kv caches, got {len(kv_caches)}")
        hidden = self.embed(input_ids)
        if lora is not None and lora.num_tokens != input_ids.shape[0]:
            raise ValueError(f"LoRA batch covers {lora.num_tokens} tokens, the batch has {input_ids.shape[0]}")
        if lora is not None and lora.has_work:
            for index, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
                hidden = layer(positions, hidden, kv_cache, meta, self.rope_table(index), lora.layer(index))
            return self.model.norm(hidden)
        for index, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            hidden = layer(positions, hidden, kv_cache, meta, self.rope_table(index))
        return self.model.norm(hidden)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.tp.embed(input_ids, self.model.embed_tokens.weight)  # F.embedding on one rank

    def rope_table(self, layer: int) -> torch.Tensor:
        """The cos/sin table layer `layer` rotates with (one for all layers here)."""
        return self.cos_sin_cache

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 (the matmul runs in the model dtype, as HF).

        Tensor parallel: the ranks' vocab rows are gathered to rank 0; the other ranks get None.
        """
        if self.lm_head is not None:  # its own, or a packed copy of the tied embedding
            return self.tp.gather_logits(self.lm_head(hidden).float())
        return self.tp.gather_logits(linear(hidden, self.lm_head_weight).float())

    # ---- weights -------------------------------------------------------------

    def _shard_rows(self, shard: str) -> tuple[int, int]:
        local = self.local_config  # this rank's (all of it without tensor parallelism)
        q, kv, inter = local.q_size, local.kv_size, local.intermediate_size
        return {"q": (0, q), "k": (q, kv), "v": (q + kv, kv), "gate": (0, inter), "up": (inter, inter)}[shard]

    def resolve_weight(self, name: str) -> tuple[str, tuple[int, int] | None] | None:
        """(parameter name, row slice or None) an HF weight name loads into; None if ignored."""
        return self._resolve(name)

    def _resolve(self, name: str) -> tuple[str, tuple[int, int] | None] | None:
        """Our parameter name and row slice for an HF weight name; None if ignored."""
        if name.endswith(_IGNORED_SUFFIXES):
            return None
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None  # the embedding is the head
        module, _, kind = name.rpartition(".")
        for hf_suffix, (fused_suffix, shard) in _STACKED_PARAMS.items():
            if module.endswith("." + hf_suffix):
                fused = module[: -len(hf_suffix)] + fused_suffix
                return f"{fused}.{kind}", self._shard_rows(shard)
        return name, None

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, sliced: bool = False) -> set[str]:
        """Copy HF-named tensors into the (fused) parameters; returns the names used.

        Tensor parallel: full tensors are sliced to this rank's part here;
        `sliced=True` says they already are (the loader's `get_slice` reads).
        Raises KeyError for a name the model does not have and ValueError for
        a shape mismatch, before touching that parameter.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            target = self._resolve(name)
            if target is None:
                continue
            param_name, rows = target
            if param_name not in params:
                _refuse_packed(self, name, param_name)
                raise KeyError(f"checkpoint weight {name!r} has no place in {self.config.architecture}")
            dst = params[param_name].data
            if not sliced:
                tensor = self.tp.shard(name, tensor)
            if rows is not None:
                dst = dst.narrow(0, rows[0], rows[1])
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dst.shape)}")
            dst.copy_(tensor)
            onednn_packed.forget()  # INVARIANT (kernels/onednn_packed.py): no packed copy outlives a write
            loaded.add(name)
        return loaded

    def checkpoint_weight_names(self) -> list[str]:
        """The HF names a complete checkpoint for this model provides."""
        unfused: dict[str, list[str]] = {}
        for hf_suffix, (fused_suffix, _) in _STACKED_PARAMS.items():
            unfused.setdefault(fused_suffix, []).append(hf_suffix)
        names = []
        for name, _ in self.named_parameters():
            module, _, kind = name.rpartition(".")
            for fused_suffix, hf_suffixes in unfused.items():
                if module.endswith("." + fused_suffix):
                    prefix = module[: -len(fused_suffix)]
                    names.extend(f"{prefix}{s}.{kind}" for s in hf_suffixes)
                    break
            else:
                names.append(name)
        return names

    # ---- KV cache --------------------------------------------------------------

    def allocate_kv_caches(
        self,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
    ) -> list[KvCache]:
        """Per layer a KvCache; dtype: the model's, or a KV cache dtype ('fp8_e4m3', ...)."""
        return allocate_kv_caches(  # this rank's KV heads under tensor parallelism
            self.local_config, num_blocks, block_size, dtype or self.dtype, device or self.device
        )


def _refuse_packed(model: nn.Module, name: str, param_name: str) -> None:
    """A float tensor for a projection kept in GGUF blocks (packed_linear.py) is a clear error."""
    module = dict(model.named_modules()).get(param_name.rpartition(".")[0])
    if module is not None and hasattr(module, "ggml_type"):
        raise ValueError(f"{name}: this projection is kept packed ({module.format_name}); float weight updates "
                         "need a server started with --gguf-dequantize")


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3: same decoder; its checkpoints already hold the fused `qkv_proj` / `gate_up_proj`.

    NOTE: `_resolve` maps those names to our parameters as they are (no row slice).
    """

    def checkpoint_weight_names(self) -> list[str]:
        return [name for name, _ in self.named_parameters()]
