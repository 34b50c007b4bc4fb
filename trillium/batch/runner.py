"""`trillium run-batch`: a batch file through the real engine and the data plane's own routes.

    prepare_files(options)          before the engine starts: paths checked, the old output
                                    cut down to its successful lines (resume), lines counted
    run_batch(engine_config, options, files, app_fields) -> BatchSummary

One process: the engine's actors run as tasks of this trio loop over
inproc:// (as `trillium.LLM`), beside one data-plane app (`create_app`) that
is never bound to a port. Each input line becomes an in-process HTTP POST to
that app (asgi_call.py), so any route the data plane serves (completions,
chat, and whatever is registered later: embeddings, score, rerank) runs with
the server's validation, defaults and error shapes.

Tasks: the reader (this loop: parse a line, skip / refuse / start it), one
task per running line (at most `max_concurrency` at once: the reader waits
for a free slot, so a huge file is never all in memory), and the writer, the
one owner of the output file and the progress bar, fed over a bounded
channel. Lines are written as they finish (not in input order: match them by
custom_id, as OpenAI's Batch API says), each flushed, so a run that dies
loses only the lines in flight and a rerun with the same -o resumes.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

import attrs
import trio

from trillium.batch.asgi_call import HttpReply, app_lifespan, post_json
from trillium.batch.lines import (
    BatchRequest,
    CustomIds,
    LineError,
    ResumeState,
    new_record_id,
    parse_line,
    resume_state,
    response_record,
)

log = logging.getLogger("trillium.batch")

_NOT_LOCAL = ("http://", "https://", "s3://", "gs://")


@attrs.frozen
class BatchOptions:
    input_path: str
    output_path: str
    max_concurrency: int  # lines in flight at once
    progress: bool = True


@attrs.frozen
class BatchFiles:
    """What `prepare_files` found: the kept output and the number of non-blank input lines."""

    resume: ResumeState
    num_lines: int


@attrs.define
class BatchSummary:
    num_succeeded: int = 0
    num_failed: int = 0
    num_skipped: int = 0


def prepare_files(options: BatchOptions) -> BatchFiles:
    """Check both paths, count the input, and rewrite the output to its successful lines
    (ValueError naming the problem; nothing is touched when one is found)."""
    for flag, path in (("-i/--input-file", options.input_path), ("-o/--output-file", options.output_path)):
        if path.startswith(_NOT_LOCAL):
            raise ValueError(f"{flag} {path}: only local paths are supported (no URL download or upload); "
                             "copy the file locally first")
    if not os.path.isfile(options.input_path):
        raise ValueError(f"-i/--input-file {options.input_path}: no such file")
    if os.path.exists(options.output_path) and os.path.samefile(options.input_path, options.output_path):
        raise ValueError("-o/--output-file is the input file; give another path")
    parent = os.path.dirname(os.path.abspath(options.output_path))
    if not os.path.isdir(parent):
        raise ValueError(f"-o/--output-file {options.output_path}: directory {parent} does not exist")
    with open(options.input_path, "rb") as f:
        num_lines = sum(1 for line in f if line.strip())
    resume = ResumeState((), frozenset(), 0)
    if os.path.exists(options.output_path):
        with open(options.output_path, encoding="utf-8", errors="replace") as f:
            resume = resume_state(f)
        # WHY a rename: a crash while rewriting never loses the kept lines.
        scratch = f"{options.output_path}.resume-{os.getpid()}"
        with open(scratch, "w", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in resume.kept_lines)
        os.replace(scratch, options.output_path)
    return BatchFiles(resume, num_lines)


def run_batch(engine_config, options: BatchOptions, files: BatchFiles, app_fields: dict[str, Any]) -> BatchSummary:
    """Run every line not done before on a resolved `engine_config` (EngineConfig.resolve);
    `app_fields`: more DataPlaneEngine fields (chat, response_role, extra_model_names)."""
    return trio.run(_main, engine_config, options, files, app_fields)


async def _main(engine_config, options: BatchOptions, files: BatchFiles, app_fields: dict[str, Any]) -> BatchSummary:
    from trillium.actors.assembly import ActorConfig, Addresses, engine_specs
    from trillium.actors.client import EngineClient
    from trillium.actors.supervisor import run_in_process

    actor_config = ActorConfig(engine_config, Addresses.inproc())
    client = EngineClient(actor_config)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(client.run)
            supervision = await nursery.start(run_in_process, engine_specs(actor_config))
            app = await _data_plane_app(engine_config, client, supervision, app_fields)
            async with app_lifespan(app):
                summary = await _BatchRun(app, options, files).run()
            nursery.cancel_scope.cancel()
    finally:
        client.close()
    return summary


async def _data_plane_app(engine_config, client, supervision, app_fields: dict[str, Any]):
    """The data plane `trillium serve` would build, minus the port, the auth and the caps that
    the batch's own concurrency bound replaces (queue and connection caps)."""
    from trillium.data_plane import DataPlaneEngine, create_app
    from trillium.data_plane.limits import RequestLimits
    from trillium.generation_defaults import load_sampling_defaults
    from trillium.models.loader import load_model_config
    from trillium.models.tokenizer import load_tokenizer
    from trillium.pooling.outputs import PoolingModel

    app_fields = dict(app_fields)
    tokenizer = await trio.to_thread.run_sync(load_tokenizer, engine_config.tokenizer_path)
    defaults = load_sampling_defaults(engine_config.model, engine_config.generation_config,
                                      engine_config.override_generation_config)
    engine = DataPlaneEngine(
        client=client, tokenizer=tokenizer,
        served_model_name=(engine_config.served_model_name, *app_fields.pop("extra_model_names", ())),
        max_model_len=engine_config.max_model_len, vocab_size=load_model_config(engine_config.model).vocab_size,
        health=lambda: (supervision.healthy, dict(supervision.alive)),
        limits=RequestLimits(max_connections=0), sampling_defaults=defaults,
        pooling=PoolingModel.build(engine_config), **app_fields,
    )
    return create_app(engine)


class _BatchRun:
    """The reader, the line tasks and the writer of one run (see the module docstring)."""

    def __init__(self, app, options: BatchOptions, files: BatchFiles) -> None:
        self._app = app
        self._options = options
        self._files = files
        self._ids = CustomIds(files.resume.done_ids)
        self._slots = trio.Semaphore(options.max_concurrency)
        self.summary = BatchSummary()

    async def run(self) -> BatchSummary:
        send, receive = trio.open_memory_channel(self._options.max_concurrency)  # dict | None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._write, receive)
            async with send:
                async with trio.open_nursery() as lines:
                    await self._read(lines, send)
        return self.summary

    async def _read(self, lines: trio.Nursery, send) -> None:
        async with await trio.open_file(self._options.input_path, "rb") as f:
            line_number = 0
            async for raw in f:
                line_number += 1
                if not raw.strip():
                    continue
                item = parse_line(raw.strip(), line_number)
                verdict = self._ids.classify(item) if isinstance(item, BatchRequest) else item
                if isinstance(verdict, LineError):
                    await send.send(verdict.record())
                elif verdict == "skip":
                    await send.send(None)
                else:
                    await self._slots.acquire()  # back-pressure: at most max_concurrency lines in flight
                    lines.start_soon(self._run_line, item, send)

    async def _run_line(self, request: BatchRequest, send) -> None:
        try:
            reply = await post_json(self._app, request.path, request.query, request.body)
            record = _record(request, reply)
        except Exception as exc:  # noqa: BLE001 - WHY: one line's failure never stops the file
            log.error("line %d (%s) failed", request.line_number, request.custom_id, exc_info=exc)
            record = LineError(request.line_number, request.custom_id, "internal_error",
                               f"{type(exc).__name__}: {exc}").record()
        finally:
            self._slots.release()
        await send.send(record)

    async def _write(self, receive) -> None:
        from tqdm import tqdm

        bar = tqdm(total=self._files.num_lines, desc="run-batch", unit="line", file=sys.stderr,
                   disable=not self._options.progress, mininterval=1.0, dynamic_ncols=True)
        with bar:
            async with await trio.open_file(self._options.output_path, "a", encoding="utf-8") as out:
                async for record in receive:
                    if record is None:
                        self.summary.num_skipped += 1
                    else:
                        await out.write(json.dumps(record, ensure_ascii=False) + "\n")
                        await out.flush()  # WHY each line: a rerun resumes from what reached the file
                        if record["error"] is None:
                            self.summary.num_succeeded += 1
                        else:
                            self.summary.num_failed += 1
                    bar.update(1)
                    bar.set_postfix(ok=self.summary.num_succeeded, failed=self.summary.num_failed,
                                    skipped=self.summary.num_skipped, refresh=False)


def _record(request: BatchRequest, reply: HttpReply) -> dict[str, Any]:
    """The output line of a request the app answered."""
    request_id = reply.headers.get("x-request-id") or new_record_id()
    content_type = reply.headers.get("content-type", "")
    body, problem = None, None
    if not content_type.startswith("application/json"):
        problem = f"{request.path} answered {reply.status} with {content_type or 'no content type'}, not JSON"
    else:
        try:
            body = reply.json()
        except ValueError:
            problem = f"{request.path} answered {reply.status} with a body that is not valid JSON"
    record = response_record(request.custom_id, reply.status, request_id, body)
    if problem is not None:
        record["error"] = {"code": "invalid_response", "message": f"line {request.line_number}: {problem}"}
    return record
