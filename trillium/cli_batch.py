"""The `trillium run-batch` flags beyond the engine's and the chat ones, and the command.

Mirrors `vllm run-batch` (vllm/entrypoints/openai/run_batch.py): -i/--input-file,
-o/--output-file, --served-model-name, --response-role, --seed, and the
engine flags of `trillium serve` (cli.py `_add_engine_args`, `_add_chat_args`).
vLLM's URL inputs and outputs (and so --output-tmp-dir) and its metrics
server flags are not accepted: argparse refuses them, and an http(s) path
exits naming it (batch/runner.py `prepare_files`).
"""

from __future__ import annotations

import argparse
import logging
import sys

log = logging.getLogger("trillium.batch")


def _non_negative(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {number}")
    return number


def add_batch_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("batch file (OpenAI's batch format, as `vllm run-batch`)")
    group.add_argument("-i", "--input-file", required=True, metavar="PATH",
                       help="local JSONL file, one request a line: {\"custom_id\", \"method\": \"POST\", "
                            "\"url\" (any POST route of the server: /v1/chat/completions, /v1/completions, "
                            "...), \"body\"}; blank lines are skipped. http(s) URLs are not supported")
    group.add_argument("-o", "--output-file", required=True, metavar="PATH",
                       help="local JSONL file of results, one line per input line ({\"id\", \"custom_id\", "
                            "\"response\": {\"status_code\", \"request_id\", \"body\"}, \"error\"}), written as "
                            "lines finish (match them by custom_id). Resumable: when PATH exists, its "
                            "successful lines are kept and their custom_ids skipped; its error lines are "
                            "dropped and those lines run again")
    group.add_argument("--max-concurrency", type=_non_negative, default=0, metavar="N",
                       help="lines in flight at once (default 0: 2 x --max-num-seqs, vLLM's bound); the "
                            "reader waits for a free slot, so a large file is never all in memory")
    group.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="model name(s) a line's body may give as `model` (default: a Hub id as given, "
                            "a path's base name)")
    group.add_argument("--response-role", default="assistant",
                       help="role of chat replies when the request adds a generation prompt")
    group.add_argument("--seed", type=int, default=0,
                       help="seed of the executor's random state (vLLM's default 0)")
    group.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                       help="a progress bar on stderr (lines done of the file, with ok / failed / skipped)")
    # What `trillium serve`'s engine config reads that run-batch has no flag for.
    parser.set_defaults(gpu_memory_utilization=None, max_queue_time_s=0.0, otlp_traces_endpoint=None,
                        collect_detailed_traces=False)


def prepare_batch(args: argparse.Namespace):
    """(BatchOptions, BatchFiles) from the flags, before the model is resolved (a Hub id may download):
    a bad path exits 2 naming it; an existing output is cut down to its successful lines (resume)."""
    from trillium.batch.runner import BatchOptions, prepare_files

    options = BatchOptions(args.input_file, args.output_file, args.max_concurrency or 2 * args.max_num_seqs,
                           progress=args.progress)
    try:
        files = prepare_files(options)
    except (ValueError, OSError) as exc:
        log.error("run-batch: %s", exc)
        raise SystemExit(2) from None
    if files.resume.done_ids or files.resume.num_dropped:
        log.info("resuming %s: %d lines done (skipped), %d error or unreadable lines dropped (run again)",
                 options.output_path, len(files.resume.done_ids), files.resume.num_dropped)
    return options, files


def run_batch_command(args: argparse.Namespace, batch, engine_config, names: tuple[str, ...], chat) -> int:
    """Run the file (`batch`: prepare_batch's); exit 0 when every line has its output line (failed
    lines included), 2 when the model cannot be used, 1 when the engine failed (130: interrupted);
    the lines finished before stay in the output, so the same command resumes."""
    from trillium.actors.supervisor import ActorFailed
    from trillium.batch.runner import run_batch

    options, files = batch
    try:
        engine_config = engine_config.resolve()
    except (ValueError, OSError) as exc:  # an unsupported model, a context that does not fit, ...
        log.error("run-batch: cannot serve %s: %s", engine_config.model, exc)
        return 2
    if engine_config.tensor_parallel_size > 1:  # WHY: the ranks are processes; run-batch runs in this one
        log.error("run-batch runs the engine in this process: --tensor-parallel-size must be 1 (serve with "
                  "`trillium serve --tensor-parallel-size %d` and send the requests to it)",
                  engine_config.tensor_parallel_size)
        return 2
    app_fields = dict(extra_model_names=names[1:], response_role=args.response_role, chat=chat)
    try:
        summary = run_batch(engine_config, options, files, app_fields)
    except KeyboardInterrupt:
        log.error("run-batch: interrupted; the finished lines are in %s: rerun the same command to resume",
                  options.output_path)
        return 130
    except (ActorFailed, BaseExceptionGroup) as exc:
        failed = exc if isinstance(exc, ActorFailed) else exc.subgroup(lambda e: isinstance(e, ActorFailed))
        if failed is None:
            raise
        log.error("run-batch: the engine failed (%s); the finished lines are in %s: rerun the same command "
                  "to resume", failed, options.output_path)
        return 1
    print(f"run-batch: {summary.num_succeeded} succeeded, {summary.num_failed} failed, "
          f"{summary.num_skipped} skipped (done before); results in {options.output_path}", file=sys.stderr)
    return 0
