"""OpenAI-style request logs (JSONL, one request per line) as a trace of keyed block ids: a team's own traffic,
logged by a gateway or an SDK wrapper, without a byte of its prompt text in the result.

Shapes of a line (the first that fits is taken):

- a bare request body: {"model", "messages" | "prompt", "max_tokens" | "max_completion_tokens", "user", ...};
- a wrapper {"request" | "body" | "request_body": BODY, "response": {..., "usage": {...}}, TIME, ...}; BODY may
  itself be an HTTP record {"headers", "body": BODY} (gateways), and the response a {"status_code", "body"}
  record (the OpenAI Batch API's output lines); `usage` is read from the response (or its body) or the line;
- TIME: the line's "timestamp", "time", "created", "created_at", "start_time", "startTime" or
  "request_time" (else the response's "created"), or the field named by --time-field (dots reach inside:
  "meta.ts"); ISO 8601 text or epoch seconds, milliseconds or microseconds (told apart by magnitude).
  A log with no times at all is replayed with --gap-s seconds between requests, in file order.

Mapping: arrival_s = time - earliest time (rows sorted, stable); input_tokens and block_hashes from the
prompt's token ids (a local tokenizer.json or the engine's /tokenize; `kvbench.trace.tokenizer`), hashed with
the KVBENCH_HASH_KEY secret (`kvbench.trace.keyed`); output_tokens = usage.completion_tokens, else the
requested budget (max_completion_tokens, max_tokens), else --output-tokens; the trace's source metadata counts
which. user_id = body "user" (or metadata user / user_id); session_id and tenant from --session-field /
--tenant-field, else metadata (session_id, conversation_id, thread_id; tenant, tenant_id, org_id) or gateway
headers (x-session-id; x-tenant-id, openai-organization); turn and parent_id follow each session in arrival
order; cache_salt from the body. Extra columns: model, recorded_cached_tokens (usage.prompt_tokens_details.
cached_tokens, or usage.cached_tokens; named as `kvbench trace record` names it), recorded_prompt_tokens (the
server's usage.prompt_tokens, to compare with our count), log_id (the line's id / request_id / custom_id, or the
response's id). request_id is "L{line}"."""

from __future__ import annotations

import datetime as _dt
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from kvbench.errors import KvbenchError, TraceFormatError
from kvbench.options import option
from kvbench.trace import keyed
from kvbench.trace.files import new_meta
from kvbench.trace.importers import block_size_option, importer, workload_option
from kvbench.trace.schema import conform
from kvbench.trace.tokenizer import LocalTokenizer, NotTokenizable, UpstreamTokenizer

BODY_KEYS = ("request", "body", "request_body")
TIME_KEYS = ("timestamp", "time", "created", "created_at", "start_time", "startTime", "request_time")
USER_KEYS = ("user", "user_id")
SESSION_KEYS = ("session_id", "conversation_id", "thread_id", "x-session-id")
TENANT_KEYS = ("tenant", "tenant_id", "org_id", "x-tenant-id", "openai-organization")
ID_KEYS = ("id", "request_id", "custom_id")
BAD_LINES_LISTED = 100  # line numbers kept in the metadata; the rest are counted


class _BadLine(Exception):
    """A line that cannot be read (the message says why); the caller adds file and line."""


def _at(rec: dict, dotted: str):
    """rec["a"]["b"] for "a.b"; None when any step is missing."""
    for part in dotted.split("."):
        if not isinstance(rec, dict) or part not in rec:
            return None
        rec = rec[part]
    return rec


def _epoch_s(value, where: str) -> float:
    """A timestamp as epoch seconds: ISO 8601 text, or a number in s, ms or us (told apart by size: 1e11 s is
    the year 5138, 1e11 ms is 1973, so no real log is ambiguous)."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            try:
                t = _dt.datetime.fromisoformat(value.strip())
            except ValueError:
                raise _BadLine(f"{where} {value!r} is neither ISO 8601 nor an epoch number") from None
            if t.tzinfo is None:
                t = t.replace(tzinfo=_dt.UTC)  # a log without a zone: all its times are read alike
            return t.timestamp()
    if isinstance(value, bool) or not isinstance(value, int | float) or not np.isfinite(value) or value < 0:
        raise _BadLine(f"{where} {value!r} is not a time (ISO 8601 text or epoch seconds/ms/us)")
    return value / 1e6 if value >= 1e14 else value / 1e3 if value >= 1e11 else float(value)


def _count(value, where: str) -> int | None:
    """A non-negative token count, or None when absent."""
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _BadLine(f"{where} should be a count of tokens >= 0, got {value!r}")
    return value


def _parts(rec: dict) -> tuple[dict, dict, dict, dict]:
    """(request body, response body, usage, headers) of one line, whatever its shape."""
    body, headers = rec, {}
    for key in BODY_KEYS:
        if isinstance(rec.get(key), dict):
            body = rec[key]
            break
    if isinstance(body.get("body"), dict) and not ("messages" in body or "prompt" in body):
        headers, body = body.get("headers") or {}, body["body"]  # an HTTP record {"headers", "body"}
    if isinstance(rec.get("headers"), dict):
        headers = rec["headers"]
    response = rec.get("response") if isinstance(rec.get("response"), dict) else {}
    if isinstance(response.get("body"), dict):
        response = response["body"]  # {"status_code", "body"}: Batch API output, gateway records
    usage = response.get("usage") if isinstance(response.get("usage"), dict) else rec.get("usage")
    headers = {str(k).lower(): v for k, v in headers.items()} if isinstance(headers, dict) else {}
    return body, response, usage if isinstance(usage, dict) else {}, headers


def _label(keys, explicit: str | None, rec: dict, body: dict, headers: dict) -> str | None:
    """A session/tenant/user label: the named field (dotted, from the line, else the body), else the first of
    `keys` in the body, its metadata, the line, the line's metadata or the headers."""
    if explicit:
        found = _at(rec, explicit)
        found = _at(body, explicit) if found is None else found
        return None if found is None else str(found)
    for place in (body, body.get("metadata"), rec, rec.get("metadata"), headers):
        if isinstance(place, dict):
            for key in keys:
                if place.get(key) not in (None, ""):
                    return str(place[key])
    return None


class _Reader:
    """Turns lines into rows (without text): token ids are hashed at once and the prompt dropped."""

    def __init__(self, tok, key: bytes, block_size: int, opts: dict):
        self.tok, self.key, self.bs, self.opts = tok, key, block_size, opts
        self.output_from = {"usage": 0, "max_tokens": 0, "default": 0}

    def row(self, rec: dict, lineno: int) -> dict:
        body, response, usage, headers = _parts(rec)
        try:
            ids = self.tok.ids(body)
        except NotTokenizable as exc:
            raise _BadLine(str(exc)) from None
        if not ids:
            raise _BadLine("the prompt has no tokens")
        out, source = _count(usage.get("completion_tokens"), "usage.completion_tokens"), "usage"
        if out is None:
            budget = body.get("max_completion_tokens", body.get("max_tokens"))
            out, source = _count(budget, "max_tokens"), "max_tokens"
        if out is None:
            out, source = self.opts["output_tokens"], "default"
        if out is None:
            raise _BadLine("no usage.completion_tokens and no max_tokens: pass --output-tokens to assume a length")
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else usage.get("cached_tokens")
        when = None
        if self.opts["time_field"]:
            raw = _at(rec, self.opts["time_field"])
            if raw is None:
                raise _BadLine(f"field {self.opts['time_field']!r} (--time-field) is missing")
            when = _epoch_s(raw, f"field {self.opts['time_field']!r}")
        else:
            for place, name in ((rec, ""), (response, "response.")):
                key = next((k for k in TIME_KEYS if place.get(k) is not None), None)
                if key is not None:
                    when = _epoch_s(place[key], f"field {name + key!r}")
                    break
        log_id = next((rec[k] for k in ID_KEYS if rec.get(k) is not None), response.get("id"))
        model = body.get("model")
        row = {
            "request_id": f"L{lineno}",
            "_time": when,
            "input_tokens": len(ids),
            "output_tokens": out,
            "block_hashes": keyed.block_ids(ids, self.bs, self.key),
            "user_id": _label(USER_KEYS, None, rec, body, {}),
            "session_id": _label(SESSION_KEYS, self.opts["session_field"], rec, body, headers),
            "tenant": _label(TENANT_KEYS, self.opts["tenant_field"], rec, body, headers),
            "cache_salt": body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None,
            "model": model if isinstance(model, str) else None,
            "recorded_cached_tokens": _count(cached, "cached_tokens"),
            "recorded_prompt_tokens": _count(usage.get("prompt_tokens"), "usage.prompt_tokens"),
            "log_id": None if log_id is None else str(log_id),
        }
        self.output_from[source] += 1  # counted last: a line found bad above is not counted
        return row


def _lines(src: Path, progress):
    """(line number, record or the reason it is unreadable) for every non-blank line; `progress(bytes read,
    bytes in all, what)` after each (tokenizing is the slow part of an import)."""
    total = src.stat().st_size
    with src.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if progress is not None:
                progress(fh.tell(), total, f"tokenizing {src.name}")
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                yield lineno, _BadLine(f"not valid JSON ({getattr(exc, 'msg', exc)})")
                continue
            yield lineno, rec if isinstance(rec, dict) else _BadLine("not a JSON object")


def _arrivals(rows: list[dict], gap_s: float, src: Path) -> tuple[np.ndarray, str]:
    """Arrival seconds from the first request, and how they were found; a log that times some lines and
    not others is an error (a guess would misplace them)."""
    times = [r["_time"] for r in rows]
    if all(t is None for t in times):
        return np.arange(len(rows)) * gap_s, f"none in the log: file order, {gap_s:g} s apart (--gap-s)"
    missing = next((r["request_id"] for r, t in zip(rows, times, strict=True) if t is None), None)
    if missing is not None:
        raise TraceFormatError(
            f"{src}: line {missing[1:]}: no timestamp, while other lines have one (name it with --time-field)"
        )
    t = np.asarray(times, dtype=np.float64)
    return t - t.min(), "log timestamps"


def _sessions(table_rows: list[dict]) -> None:
    """turn and parent_id along each session, in arrival order (in place)."""
    last: dict[str, tuple[str, int]] = {}
    for r in table_rows:
        sid = r["session_id"]
        if sid is None:
            r["turn"], r["parent_id"] = None, None
            continue
        parent, turn = last.get(sid, (None, -1))
        r["turn"], r["parent_id"] = turn + 1, parent
        last[sid] = (r["request_id"], turn + 1)


COLUMN_TYPES = {
    "user_id": pa.string(), "session_id": pa.string(), "tenant": pa.string(), "cache_salt": pa.string(),
    "model": pa.string(), "recorded_cached_tokens": pa.int32(), "recorded_prompt_tokens": pa.int32(),
    "log_id": pa.string(), "turn": pa.int32(), "parent_id": pa.string(), "workload": pa.string(),
}  # fmt: skip


@dataclass(frozen=True)
class OpenAiLogOptions:
    tokenizer: str | None = option(
        None,
        "path of a tokenizer.json (read with the tokenizers package; chat messages rendered as role/content "
        "lines); this or --tokenize-url",
        unit="path",
    )
    tokenize_url: str | None = option(
        None,
        "base URL of the engine whose /tokenize gives the token ids (vLLM, SGLang; chat template applied "
        "there), e.g. http://localhost:8000",
        unit="URL",
    )
    block_size: int = block_size_option(16, "tokens per hash block (the engine's KV block/page size, e.g. vLLM's 16)")
    time_field: str | None = option(
        None,
        "field holding each line's time, dots reaching inside (e.g. meta.ts); ISO 8601 or epoch s/ms/us (told "
        "apart by size) [default: the line's timestamp, time, created, created_at, start_time, startTime or "
        "request_time, else the response's created]",
        unit="name",
    )
    gap_s: float = option(0.0, "seconds between consecutive requests when the log has no timestamps at all", unit="s")
    output_tokens: int | None = option(
        None,
        "output tokens assumed for a request with neither usage.completion_tokens nor max_tokens [default: "
        "such a line is an error]",
        unit="tokens",
    )
    session_field: str | None = option(
        None,
        "field naming the session (dots reach inside) [default: metadata session_id, conversation_id, "
        "thread_id or header x-session-id]",
        unit="name",
    )
    tenant_field: str | None = option(
        None,
        "field naming the tenant [default: metadata tenant, tenant_id, org_id or header x-tenant-id, "
        "openai-organization]",
        unit="name",
    )
    skip_bad_lines: bool = option(
        False,
        "skip lines that cannot be read, count them and list their numbers on stderr and in the trace's source "
        "metadata [default: the first is an error naming file and line]",
        unit="on/off",
        is_flag=True,
    )
    workload: str | None = workload_option("workload label on every request [default: openai-log]")


@importer("openai-log", OpenAiLogOptions)
def read_openai_log(
    src: Path,
    tokenizer: str | None = None,
    tokenize_url: str | None = None,
    block_size: int = 16,
    time_field: str | None = None,
    gap_s: float = 0.0,
    output_tokens: int | None = None,
    session_field: str | None = None,
    tenant_field: str | None = None,
    skip_bad_lines: bool = False,
    workload: str | None = None,
    progress=None,
):
    """OpenAI-style request logs (JSONL: request bodies, or {time, request, response/usage} records; keyed ids)."""
    src = Path(src)
    key = keyed.hash_key()  # first: a missing secret is said before any work
    if (tokenizer is None) == (tokenize_url is None):
        raise KvbenchError("give exactly one of --tokenizer tokenizer.json and --tokenize-url URL")
    if isinstance(output_tokens, str):  # the command line passes an option without a typed default as text
        if not output_tokens.isdigit():
            raise KvbenchError(f"--output-tokens {output_tokens!r} must be a whole number of tokens >= 0")
        output_tokens = int(output_tokens)
    if block_size < 1 or not np.isfinite(gap_s) or gap_s < 0 or (output_tokens is not None and output_tokens < 0):
        raise KvbenchError("--block-size must be >= 1, --gap-s a finite number >= 0, --output-tokens >= 0")
    if not src.exists():
        raise TraceFormatError(f"{src}: no such file")
    tok = LocalTokenizer(tokenizer) if tokenizer is not None else UpstreamTokenizer(tokenize_url)
    opts = {"time_field": time_field, "output_tokens": output_tokens}
    reader = _Reader(tok, key, block_size, {**opts, "session_field": session_field, "tenant_field": tenant_field})
    rows, bad = [], []
    for lineno, rec in _lines(src, progress):
        try:
            if isinstance(rec, _BadLine):
                raise rec
            rows.append(reader.row(rec, lineno))
        except _BadLine as exc:
            if not skip_bad_lines:
                raise TraceFormatError(f"{src}: line {lineno}: {exc} (--skip-bad-lines skips such lines)") from None
            bad.append((lineno, str(exc)))
    if not rows:
        raise TraceFormatError(f"{src}: no readable requests" + (f" ({len(bad)} bad lines)" if bad else ""))
    if bad:  # never dropped silently: said here and kept in the trace's metadata
        print(f"kvbench: skipped {len(bad)} unreadable lines of {src} (first: line {bad[0][0]}: {bad[0][1]})",
              file=sys.stderr)  # fmt: skip
    arrival, timing = _arrivals(rows, gap_s, src)
    order = np.argsort(arrival, kind="stable")
    rows = [rows[i] for i in order]
    for r, t in zip(rows, arrival[order], strict=True):
        r["arrival_s"] = float(t)
        r["workload"] = workload or "openai-log"
        del r["_time"]
    _sessions(rows)
    hashes = pa.array([r.pop("block_hashes") for r in rows], pa.list_(pa.uint64()))
    columns = {k: pa.array([r[k] for r in rows], COLUMN_TYPES.get(k)) for k in rows[0]}
    columns["block_hashes"] = hashes
    table = pa.table(columns)
    for name in ("workload", "tenant", "model"):  # few distinct values each
        table = table.set_column(table.column_names.index(name), name, table.column(name).dictionary_encode())
    source = {
        "importer": "openai-log",
        "file": src.name,
        "tokenizer": tok.name,
        "hash": "keyed blake2b (KVBENCH_HASH_KEY; the key is not stored)",
        "arrivals": timing,
        "output_tokens_from": reader.output_from,  # usage = generated; max_tokens = requested budget
        "skipped_lines": len(bad),
        "skipped_line_numbers": [n for n, _ in bad[:BAD_LINES_LISTED]],
        "reordered": bool(np.any(order != np.arange(len(order)))),
    }
    return conform(table), new_meta(block_size, source)
