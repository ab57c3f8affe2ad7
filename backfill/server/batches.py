"""The Batch API worker: validates input files, feeds their lines to the engine as OFFLINE requests,
and records each result durably (ConServe §3: offline work is submitted as a batch and fills the
capacity online requests leave idle).

Statuses: validating -> in_progress -> finalizing -> completed; cancelling -> cancelled; failed
(the input file fails validation: every reason is listed in the batch's errors); expired (the 24 h window passed). A batch line is
recorded exactly once (see store.py); lines in flight when the process dies run again on restart.
At most max_in_flight lines are in the engine at once, so offline work never fills the
scheduler's queue or KV pool ahead of online arrivals.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import sqlite3
import time
import uuid
from typing import Callable

from backfill.errors import BackfillError
from backfill.server.completions import CompletionService, check_outcome, response_body
from backfill.server.errors import APIError, from_backfill_error
from backfill.server.schemas import BatchLine, parse_json, validate_body
from backfill.server.store import LineFailure, PendingLine, Store
from backfill.server.store_integrity import DamagedContentError
from backfill.types import FinishReason, RequestClass

log = logging.getLogger(__name__)

MAX_BATCH_LINES = 50_000   # OpenAI's limit per batch
RECORD_ATTEMPTS = 3        # tries to commit one line's result before marking the line failed
RECORD_RETRY_DELAY_S = 0.2
MAX_LISTED_ERRORS = 1000  # validation errors listed in a failed batch's errors
MAX_LINE_ATTEMPTS = 3      # runs of one line that end without an answer before it is marked failed
MAX_BACKOFF_S = 30.0       # the longest pause between tries after store errors
_KIND = {"/v1/chat/completions": "chat", "/v1/completions": "text"}
# A line's prefix key: a short hash of each successive stretch of its prompt, so lines sharing a prompt
# prefix share the key's leading hashes and sort together (HyGen's prefix-sharing order, as a walk of
# the prefix tree at this granularity); a bounded number of stretches keeps the key short.
PREFIX_KEY_STRETCH_CHARS = 256
PREFIX_KEY_MAX_STRETCHES = 64


def error_record(custom_id: str | None, code: str, message: str, line: int | None = None) -> str:
    """An error-file line for a request that never got a response (OpenAI's shape)."""
    error = {"code": code, "message": message}
    if line is not None:
        error["line"] = line
    return json.dumps({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
                       "error": error}, ensure_ascii=False)


def response_record(custom_id: str, status_code: int, request_id: str, body: dict) -> str:
    return json.dumps({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
                       "response": {"status_code": status_code, "request_id": request_id, "body": body},
                       "error": None}, ensure_ascii=False)


def prefix_order_key(endpoint: str, body: dict) -> str:
    """What decides a line's prompt prefix (model, tools, then the messages or the prompt), in a
    canonical text, cut into stretches, each named by a 32-bit hash: lines whose prompts start the
    same share the key's start, so ordering by key runs them together."""
    prompt = body.get("messages") if _KIND.get(endpoint) == "chat" else body.get("prompt")
    text = json.dumps([body.get("model"), body.get("tools"), prompt], ensure_ascii=False, sort_keys=True,
                      separators=(",", ":"))
    stretch = PREFIX_KEY_STRETCH_CHARS
    return "".join(hashlib.blake2b(text[i:i + stretch].encode(), digest_size=4).hexdigest()
                   for i in range(0, min(len(text), stretch * PREFIX_KEY_MAX_STRETCHES), stretch))


def parse_batch_input(content: bytes, endpoint: str, check_body: Callable[[dict], None]
                      ) -> tuple[list[tuple[int, str, str, str]], list[LineFailure], list[dict]]:
    """(runnable lines, failed lines, validation errors), as OpenAI validates a batch's input file.

    A file with any malformed line (not JSON, not a request object, a url other than the batch's
    endpoint, a repeated custom_id, an unknown model) fails validation as a whole, with every
    reason in the batch's `errors` (at most MAX_LISTED_ERRORS); nothing of it runs. A well-formed
    line whose body the endpoint refuses (a bad temperature, a prompt too long) runs as OpenAI
    runs it: its 4xx response goes to the error file and the other lines go on.
    """
    raw_lines = content.split(b"\n")
    numbered = [(i, raw) for i, raw in enumerate(raw_lines) if raw.strip()]
    if not numbered:
        return [], [], [validation_entry("empty_file", "the input file has no requests")]
    if len(numbered) > MAX_BATCH_LINES:
        return [], [], [validation_entry("too_many_requests", f"the input file has {len(numbered)} requests; "
                                         f"at most {MAX_BATCH_LINES} are allowed")]
    runnable: list[tuple[int, str, str, str]] = []
    failures: list[LineFailure] = []
    errors: list[dict] = []
    seen: set[str] = set()
    for index, raw in numbered:
        number = index + 1
        try:
            data = parse_json(raw)
        except APIError as exc:
            errors.append(validation_entry("invalid_json_line", f"line {number}: {exc.message}", number))
            continue
        try:
            line = validate_body(BatchLine, data)
        except APIError as exc:
            errors.append(validation_entry("invalid_request", f"line {number}: {exc.message}", number, exc.param))
            continue
        if line.url != endpoint:
            errors.append(validation_entry("invalid_url", f"line {number}: url {line.url!r} differs from the "
                                           f"batch's endpoint {endpoint!r}", number, "url"))
            continue
        if line.custom_id in seen:
            errors.append(validation_entry("duplicate_custom_id", f"line {number}: custom_id {line.custom_id!r} "
                                           "is repeated; each line needs its own", number, "custom_id"))
            continue
        seen.add(line.custom_id)
        try:
            check_body(line.body)
        except BackfillError as exc:
            api = from_backfill_error(exc)
            if api.code == "model_not_found":
                errors.append(validation_entry("model_not_found", f"line {number}: {api.message}", number,
                                               "body.model"))
                continue
            failures.append(LineFailure(index, line.custom_id, response_record(
                line.custom_id, api.status_code, f"req_{uuid.uuid4().hex}", api.body())))
            continue
        runnable.append((index, line.custom_id, json.dumps(line.body, ensure_ascii=False),
                         prefix_order_key(endpoint, line.body)))
    if len(errors) > MAX_LISTED_ERRORS:
        more = len(errors) - MAX_LISTED_ERRORS
        errors = errors[:MAX_LISTED_ERRORS] + [validation_entry("too_many_errors", f"and {more} more invalid lines")]
    return runnable, failures, errors


def backoff_s(base_s: float, failures: int) -> float:
    """The pause after the failures-th failure in a row: doubling from base_s, at most MAX_BACKOFF_S."""
    return min(MAX_BACKOFF_S, base_s * 2 ** max(0, failures - 1))


def validation_entry(code: str, message: str, line: int | None = None, param: str | None = None) -> dict:
    """One entry of a failed batch's errors.data (OpenAI's shape)."""
    return {"code": code, "message": message, "param": param, "line": line}


class BatchWorker:
    def __init__(self, store: Store, service: CompletionService, max_in_flight: int = 64,
                 poll_interval_s: float = 0.5, idle_poll_interval_s: float = 5.0) -> None:
        self.store = store
        self.service = service
        self.max_in_flight = max_in_flight
        self.poll_interval_s = poll_interval_s
        # With no batch open, polling the store is event-loop work that shares the GIL with the
        # engine's steps for nothing: creating or cancelling a batch wakes the worker at once, so
        # an idle worker only looks now and then (for a batch another process put in the store).
        self.idle_poll_interval_s = max(idle_poll_interval_s, poll_interval_s)
        self._tasks: dict[tuple[str, int], asyncio.Task] = {}
        # Batches whose validation hit a store error: (tries, monotonic time of the next try).
        self._validation_retry: dict[str, tuple[int, float]] = {}
        self._attempts: dict[tuple[str, int], int] = {}   # runs of a line without a stored result
        self.unwritable: set[tuple[str, int]] = set()     # lines whose result the store refused for good
        self._wake = asyncio.Event()
        self._accepting = True
        self._stopped = False
        self._main: asyncio.Task | None = None

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def start(self) -> None:
        self._accepting = True
        self._stopped = False
        self._main = asyncio.create_task(self._loop(), name="backfill-batch-worker")

    def wake(self) -> None:
        self._wake.set()

    def stop_accepting(self) -> None:
        """Start no new lines (graceful shutdown); lines in flight may still finish."""
        self._accepting = False

    async def stop(self, deadline_s: float) -> None:
        """Let lines in flight finish until deadline_s (monotonic), then cancel the rest: they stay
        pending in the database and run again after a restart."""
        self._accepting = False
        while self._tasks and time.monotonic() < deadline_s:
            await asyncio.wait(list(self._tasks.values()), timeout=max(0.0, deadline_s - time.monotonic()))
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        if self._main is not None:
            # The flag, not only the cancel, ends the loop: on Python 3.11 asyncio.wait_for swallows
            # a cancel that lands as its awaited event is set (lines finishing here set _wake).
            self._stopped = True
            self._wake.set()
            self._main.cancel()
            tasks.append(self._main)
        await asyncio.gather(*tasks, return_exceptions=True)
        self._main = None

    async def _loop(self) -> None:
        failures = 0
        while not self._stopped:
            self._wake.clear()   # before the tick: a wake-up during it triggers the next one at once
            busy = True
            try:
                busy = await self._tick()
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a database hiccup must not end offline processing for good
                # One line per failure, and ever longer pauses while it lasts: a store that keeps
                # failing must not fill the log with a traceback every poll.
                failures += 1
                delay_s = backoff_s(self.poll_interval_s, failures)
                log.warning("batch worker: a look at the store failed (%s: %s); retrying in %.1f s",
                            type(exc).__name__, exc, delay_s, exc_info=log.isEnabledFor(logging.DEBUG))
                await asyncio.sleep(delay_s)
                continue
            try:
                await asyncio.wait_for(self._wake.wait(), self.poll_interval_s if busy else self.idle_poll_interval_s)
            except asyncio.TimeoutError:
                pass

    async def _tick(self) -> bool:
        """One look at the store; whether any batch is open (validating, cancelling, running)."""
        store = self.store
        validating = await asyncio.to_thread(store.batch_ids, "validating")
        for batch_id in set(self._validation_retry) - set(validating):   # cancelled meanwhile
            del self._validation_retry[batch_id]
        for batch_id in validating:
            await self._validate_isolated(batch_id)
        cancelling = await asyncio.to_thread(store.batch_ids, "cancelling")
        for batch_id in cancelling:
            await self._end(batch_id, "cancelled")
        now = int(time.time())
        running = await asyncio.to_thread(store.running_batches)
        for batch_id, status, expires_at, pending in running:
            if status == "in_progress" and expires_at is not None and expires_at <= now:
                await self._end(batch_id, "expired")
            elif pending == 0 and not self._has_in_flight(batch_id):
                await asyncio.to_thread(store.mark_finalizing, batch_id)
                await asyncio.to_thread(store.finish_batch, batch_id, "completed")
        free = self.max_in_flight - len(self._tasks)
        if self._accepting and free > 0 and self.service.engine.running:
            skip = set(self._tasks) | self.unwritable
            for line in await asyncio.to_thread(store.pending_lines, free, skip):
                key = (line.batch_id, line.line)
                self._tasks[key] = asyncio.create_task(self._run_line(line), name=f"batch-line-{key}")
        return bool(validating or cancelling or running or self._tasks)

    def _has_in_flight(self, batch_id: str) -> bool:
        return any(key[0] == batch_id for key in self._tasks)

    async def _end(self, batch_id: str, status: str) -> None:
        """Cancel a batch's lines in flight; once none is left, write its files and final status."""
        tasks = [task for key, task in self._tasks.items() if key[0] == batch_id]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.to_thread(self.store.finish_batch, batch_id, status)

    async def _validate_isolated(self, batch_id: str) -> None:
        """Validate one batch without letting its failure hold up the others: an input file whose
        stored bytes are damaged fails the batch at once (the error names the damage), and so does
        a crash; a store that is busy or failing (OperationalError) puts the batch aside for a
        growing pause. Each is one log line per try."""
        retry = self._validation_retry.get(batch_id)
        if retry is not None and time.monotonic() < retry[1]:
            return
        try:
            await self._validate(batch_id)
        except (DamagedContentError, sqlite3.DatabaseError) as exc:
            if isinstance(exc, sqlite3.OperationalError):   # locked, busy, I/O: may pass; try again later
                attempts = (retry[0] if retry else 0) + 1
                delay_s = backoff_s(self.poll_interval_s, attempts)
                self._validation_retry[batch_id] = (attempts, time.monotonic() + delay_s)
                log.warning("batch %s: reading its input failed (%s); trying again in %.1f s", batch_id, exc,
                            delay_s)
                return
            log.error("batch %s failed: its input file cannot be read: %s", batch_id, exc)
            entry = validation_entry("input_file_damaged", f"the input file cannot be read: {exc}",
                                     param="input_file_id")
        except Exception:   # a bug: fail this batch (its traceback logged once), not every batch after it
            log.exception("batch %s failed: validating its input crashed", batch_id)
            entry = validation_entry("validation_crashed", "validating the input file failed on an internal "
                                     "error (logged by the server)")
        else:
            self._validation_retry.pop(batch_id, None)
            return
        self._validation_retry.pop(batch_id, None)
        await asyncio.to_thread(self.store.fail_batch, batch_id, [entry])

    async def _validate(self, batch_id: str) -> None:
        row = await asyncio.to_thread(self.store.batch_row, batch_id)
        content = await asyncio.to_thread(self.store.file_content, row["input_file_id"])
        if content is None:
            await asyncio.to_thread(self.store.fail_batch, batch_id, [
                {"code": "file_not_found", "message": f"input file {row['input_file_id']} no longer exists",
                 "param": "input_file_id", "line": None}])
            return
        kind = _KIND[row["endpoint"]]
        lines, failures, errors = await asyncio.to_thread(
            parse_batch_input, content, row["endpoint"], lambda body: self._check_body(kind, body))
        if errors:
            await asyncio.to_thread(self.store.fail_batch, batch_id, errors)
            return
        await asyncio.to_thread(self.store.start_batch, batch_id, lines, failures)

    def _check_body(self, kind: str, body: dict) -> None:
        self.service.validate(kind, body)
        if body.get("stream"):
            raise APIError(400, "stream is not supported in batch requests", param="stream")

    async def _run_line(self, line: PendingLine) -> None:
        key = (line.batch_id, line.line)
        try:
            self._attempts[key] = self._attempts.get(key, 0) + 1
            result = await self._execute(line)
            if result is None and self._attempts[key] >= MAX_LINE_ATTEMPTS:
                # Each run ended without an answer (the engine stopping under it): give up on the
                # line rather than run its inference without end.
                result = (False, error_record(line.custom_id, "line_attempts_exhausted",
                                              f"the request ran {MAX_LINE_ATTEMPTS} times without finishing"),
                          0, 0, 0)
            if result is not None:
                write = asyncio.ensure_future(self._record(line, result))
                try:
                    await asyncio.shield(write)
                except asyncio.CancelledError:
                    # A result being committed is kept: finish it before the batch is finalized.
                    await write
                    raise
        except asyncio.CancelledError:
            raise
        finally:
            self._tasks.pop(key, None)
            self._wake.set()

    async def _record(self, line: PendingLine, result: tuple[bool, str, int, int, int]) -> None:
        """Commit a line's result with bounded retries; if the store keeps refusing it, mark the line
        failed instead; if even that fails, never run the line again in this process (its inference
        is not repeated without end; /health reports the store's error)."""
        key = (line.batch_id, line.line)
        ok, record, input_tokens, output_tokens, cached_tokens = result
        for attempt in range(RECORD_ATTEMPTS):
            try:
                await asyncio.to_thread(self.store.record_result, line.batch_id, line.line, line.custom_id, ok,
                                        record, input_tokens, output_tokens, cached_tokens)
                self._attempts.pop(key, None)
                return
            except Exception as exc:
                log.warning("batch %s line %d: storing the result failed (attempt %d of %d): %s",
                            line.batch_id, line.line, attempt + 1, RECORD_ATTEMPTS, exc)
                await asyncio.sleep(RECORD_RETRY_DELAY_S * 2 ** attempt)
        failure = error_record(line.custom_id, "result_not_stored",
                               f"the result could not be stored after {RECORD_ATTEMPTS} attempts")
        try:
            await asyncio.to_thread(self.store.record_result, line.batch_id, line.line, line.custom_id, False,
                                    failure)
            log.error("batch %s line %d marked failed: its result could not be stored", line.batch_id, line.line)
            self._attempts.pop(key, None)
        except Exception:
            self.unwritable.add(key)
            log.exception("batch %s line %d: the store refuses even its failure; the line will not run again "
                          "until the server restarts on a repaired database", line.batch_id, line.line)

    async def _execute(self, line: PendingLine) -> tuple[bool, str, int, int, int] | None:
        """(ok, record, input tokens, output tokens, cached input tokens), or None to leave the line pending."""
        try:
            prepared = self.service.prepare(_KIND[line.endpoint], json.loads(line.body), RequestClass.OFFLINE)
            outcome = await self.service.run(prepared, {"backfill.batch_id": line.batch_id,
                                                        "backfill.batch_line": line.line,
                                                        "backfill.custom_id": line.custom_id})
            if outcome.finish_reason is FinishReason.CANCELLED:
                return None  # the engine is stopping; run it again later
            check_outcome(outcome.finish_reason)
        except BackfillError as exc:
            api = from_backfill_error(exc)
            if api.status_code == 503:
                return None
            return False, response_record(line.custom_id, api.status_code, f"req_{uuid.uuid4().hex}",
                                          api.body()), 0, 0, 0
        except Exception:
            # A bug on this line must not stall the whole batch by being retried forever.
            log.exception("batch %s line %d crashed", line.batch_id, line.line)
            api = APIError(500, "internal server error while running this request", code="internal_error",
                           type="server_error")
            return False, response_record(line.custom_id, 500, f"req_{uuid.uuid4().hex}", api.body()), 0, 0, 0
        body = response_body(prepared, outcome, self.service.token_text)
        return (True, response_record(line.custom_id, 200, prepared.response_id, body),
                outcome.num_prompt_tokens, outcome.num_output_tokens, outcome.num_cached_tokens)
