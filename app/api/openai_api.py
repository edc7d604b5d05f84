"""OpenAI-compatible endpoints on the app's own server: ``GET /v1/models``,
``POST /v1/chat/completions`` and ``POST /v1/completions`` (whole answers, or streamed as
server-sent events). Request bodies are checked in :mod:`app.api.openai_requests`; this module
answers them.

Requests join the same worker queue as the browser tabs, so the API and the UI share the one
engine fairly (first come, first served). Bad input is answered with OpenAI's error shape,
``{"error": {"message", "type", "param", "code"}}``, and a 4xx status before anything runs.

Honoured: ``model`` (the pair's target id), ``messages`` (system/developer anywhere, user, assistant;
text content), ``temperature`` (default 1, as OpenAI's; 0 is greedy and exact), ``top_p``,
``max_tokens`` / ``max_completion_tokens`` (default: the rest of the context), ``seed`` (default: a
fresh one), ``stop`` (up to 4 strings, cut from the text),
``stream`` and ``stream_options.include_usage``, ``n`` (1 only), ``user`` (a conversation key:
requests with the same ``user`` reuse one conversation KV cache, like a browser session) and
``prediction`` (Predicted Outputs: the expected answer is copied from as a free branch of every
step's tree; ``usage.completion_tokens_details`` counts its accepted and rejected tokens).
``logprobs`` / ``top_logprobs`` (0 to 20; chat) and ``logprobs`` (0 to 5; text completions): the
target's own log-probability of each token shown and of its most likely alternatives, the
log_softmax of its raw logits (temperature 1, no top-p) whatever the sampling settings, as
llama-server and vLLM report them (:mod:`app.api.openai_logprobs`); streamed, a chunk carries the
entries of the tokens whose text it completes, and no entry follows a stop string's cut.
An extension field ``sequoia`` picks the tree: ``{"tree_size", "depth", "method", "auto"}``.

While a long prompt is read, a stream sends SSE comments (``: reading the prompt, n/N tokens``),
which clients skip, and no data until the first token.

Every answer carries ``sequoia``: the tree (size, depth, parents), method, steps, tokens/step,
accepted and drafted tokens, acceptance rate, prefill/decode/first-token seconds and the prompt
tokens reused from the conversation cache (in the last chunk when streaming).
"""
from __future__ import annotations

import ipaddress
import json
import logging
import queue
import secrets
import time
import uuid
from collections.abc import AsyncIterator

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from app.serving.jobs import TERMINAL, Event, Job, QueueFull
from app.api.growing_text import GrowingText
from app.api.openai_logprobs import LogprobTrail, Scored, chat_logprobs, legacy_logprobs
from app.api.openai_requests import APIError, ChatCall, model_id, parse_body, parse_chat, parse_completion, read_body
from app.serving.worker import Worker

# Threads that wait on jobs' events for the API, apart from the pool Gradio's handlers (Stop and
# Clear included) draw from: however many API calls wait, the UI keeps its threads.
API_WAITERS = anyio.CapacityLimiter(8)
DISCONNECT_CHECK_S = 0.25  # how often a whole answer's wait asks whether its client is still there
OWNER = "sequoia-chat"
log = logging.getLogger(__name__)


# ----- answers -------------------------------------------------------------------------------
class Answer:
    """A job's committed tokens as text: stop strings cut it, and streamed deltas never show part
    of a stop string or of a character still being spelled by byte tokens. With ``logprobs``
    (the records carry token logprobs), ``trail`` releases each token's entry with its text."""

    def __init__(self, tokenizer, stops: list[str], logprobs: bool = False) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.growing = GrowingText(tokenizer)
        self.tokens: list[int] = self.growing.tokens
        self.records: list = []
        self.text = ""
        self.sent = 0
        self.stopped = False  # a stop string was found
        self.trail = LogprobTrail() if logprobs else None

    def add(self, record) -> str:
        """Take one step's record; the text that may be sent now."""
        self.records.append(record)
        ends = self.growing.extend(record.committed, each=self.trail is not None)
        self.text = self.growing.text
        if self.trail is not None:
            self.trail.extend(self.tokenizer, record, self.text, ends)
        cut = min((i for i in (self.text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = self.text[:cut], True
            return self.flush()
        safe = len(self.text.rstrip("\ufffd"))
        held = max((k for s in self.stops for k in range(1, len(s)) if self.text[:safe].endswith(s[:k])), default=0)
        return self._send(safe - held)

    def flush(self) -> str:
        """Everything not sent yet."""
        return self._send(len(self.text))

    def _send(self, upto: int) -> str:
        delta = self.text[self.sent:upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        if self.trail is not None:
            self.trail.release(self.sent)
        return delta

    def logprobs(self, text: bool, entries: list[Scored] | None = None) -> dict | None:
        """A choice's ``logprobs`` for ``entries`` (by default every token released so far): the chat
        shape, or the legacy one for a text completion; None when they were not asked for."""
        if self.trail is None:
            return None
        entries = self.trail.released if entries is None else entries
        return legacy_logprobs(entries) if text else chat_logprobs(entries)


def speculation(answer: Answer, started: dict | None, finished: dict | None) -> dict:
    """The ``sequoia`` field: the tree, method and how speculation went."""
    steps = answer.records
    copied = sum(s.sources.count("copy") for s in steps)
    drafted = sum(len(s.tokens) - 1 for s in steps) - copied
    accepted = sum(s.accepted_draft_tokens for s in steps)
    tokens = sum(len(s.committed) for s in steps)
    decision = (started or {}).get("decision")
    tree = decision.tree if decision is not None and decision.drafts else None
    finished = finished or {}
    return {
        "method": steps[0].method if steps else None,
        "tree": {"size": tree.size, "depth": tree.depth, "parents": list(tree.parents)} if tree is not None else None,
        "auto": decision is not None and decision.auto,
        "steps": len(steps),
        "tokens_per_step": tokens / len(steps) if steps else 0.0,
        "accepted_draft_tokens": accepted,
        "accepted_by_source": {source: sum(s.accepted_by_source()[source] for s in steps) for source in ("draft", "copy")},
        "drafted_tokens": drafted,
        "copied_tokens": copied,
        "acceptance_rate": accepted / (drafted + copied) if drafted + copied else None,
        "prefill_s": finished.get("prefill_s"),
        "decode_s": finished.get("decode_s"),
        "first_token_s": finished.get("first_token_s"),
        "reused_prompt_tokens": finished.get("reused_tokens", 0),
    }


def _usage(call: ChatCall, answer: Answer) -> dict:
    completion = len(answer.tokens)
    usage = {"prompt_tokens": call.prompt_tokens, "completion_tokens": completion,
             "total_tokens": call.prompt_tokens + completion}
    if call.prediction_tokens:  # as OpenAI reports Predicted Outputs
        accepted = min(call.prediction_tokens, sum(_accepted_from(record, PREDICTION_DOCUMENT)
                                                   for record in answer.records))
        usage["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                              "rejected_prediction_tokens": call.prediction_tokens - accepted}
    return usage


PREDICTION_DOCUMENT = 1  # the engine's copy index: 0 is the prompt and answer, 1 the prediction


def _accepted_from(record, document: int) -> int:
    """Committed tokens of one step copied from ``document`` of the engine's context index."""
    if not record.copy_origins:
        return 0
    path = record.accepted[1:record.accepted_draft_tokens + 1]
    return sum(1 for node in path if record.copy_origins[node] is not None and record.copy_origins[node][0] == document)


def _finish_reason(answer: Answer, finished: dict | None) -> str:
    if answer.stopped:
        return "stop"
    return "length" if (finished or {}).get("finish_reason") == "length" else "stop"


def _failure(message: str) -> APIError:
    return APIError(500, f"the engine failed: {message}", None, "engine_error", "server_error")


def submit(worker: Worker, call: ChatCall, client: str | None) -> Job:
    """Queue ``call`` for ``client``; a full queue is a 429 with ``Retry-After``."""
    try:
        return worker.submit(call.request, client=client)
    except QueueFull as exc:
        raise APIError(429, str(exc), code="rate_limit_exceeded", kind="rate_limit_error",
                       headers={"Retry-After": str(exc.retry_after)}) from None


async def events(job: Job, http: Request | None = None) -> AsyncIterator[Event]:
    """``job``'s events up to its terminal one, waited for in the API's own threads. With ``http``,
    the job is cancelled as soon as that client has gone away."""
    checked = time.monotonic()
    while True:
        event = await anyio.to_thread.run_sync(_next_event, job, limiter=API_WAITERS)
        if http is not None and not job.cancelled and time.monotonic() - checked > DISCONNECT_CHECK_S:
            checked = time.monotonic()
            if await http.is_disconnected():
                job.cancel()
        if event is None:
            continue
        yield event
        if event.kind in TERMINAL:
            return


async def complete(worker: Worker, call: ChatCall, job: Job, http: Request | None = None) -> dict:
    """Run ``job`` to the end; the ``chat.completion`` object. Cancelled if ``http`` disconnects."""
    answer = Answer(worker.tokenizer, call.stops, call.logprobs is not None)
    started = finished = None
    async for event in events(job, http):
        started, finished = _note(event, started, finished, answer)
        if event.kind == "step" and event.phase == "main" and not answer.stopped:
            answer.add(event.data)
            if answer.stopped:
                job.cancel()
        elif event.kind == "error":
            raise _failure(str(event.data))
        elif event.kind == "cancelled" and not answer.stopped:
            raise _failure("the request was cancelled")
    answer.flush()
    choice = {"text": answer.text} if call.text else {"message": {"role": "assistant", "content": answer.text}}
    return {"id": _id(call), "object": "text_completion" if call.text else "chat.completion",
            "created": int(time.time()), "model": call.model,
            "choices": [{"index": 0, **choice, "finish_reason": _finish_reason(answer, finished),
                         "logprobs": answer.logprobs(call.text)}],
            "usage": _usage(call, answer), "sequoia": speculation(answer, started, finished)}


def _id(call: ChatCall) -> str:
    return f"{'cmpl' if call.text else 'chatcmpl'}-{uuid.uuid4().hex}"


def _note(event: Event, started: dict | None, finished: dict | None,
          answer: Answer) -> tuple[dict | None, dict | None]:
    """Keep the main run's "started" and "finished" data; the answer is decoded with the tokenizer
    of the pair that serves the job (a model swap may have run ahead of it)."""
    if event.phase == "main" and event.kind == "started":
        started = event.data
        answer.tokenizer = (started or {}).get("tokenizer") or answer.tokenizer
    if event.phase == "main" and event.kind == "finished":
        finished = event.data
    return started, finished


def _next_event(job: Job) -> Event | None:
    try:
        return job.events.get(timeout=0.2)
    except queue.Empty:
        return None


async def stream(worker: Worker, call: ChatCall, job: Job) -> AsyncIterator[str]:
    """Server-sent events of ``chat.completion.chunk`` objects, then ``[DONE]``. The job is cancelled
    when the client goes away (the server stops this generator)."""
    answer = Answer(worker.tokenizer, call.stops, call.logprobs is not None)
    base = {"id": _id(call), "object": "text_completion" if call.text else "chat.completion.chunk",
            "created": int(time.time()), "model": call.model}

    def chunk(delta: dict, finish: str | None = None, **extra) -> str:
        """A chunk carrying ``delta`` and the logprob entries of the tokens released with it."""
        part = {"text": delta.get("content", "")} if call.text else {"delta": delta}
        entries = answer.trail.take() if answer.trail is not None else []
        logprobs = answer.logprobs(call.text, entries) if entries else None
        return "data: " + json.dumps({**base, "choices": [{"index": 0, **part, "finish_reason": finish,
                                                           "logprobs": logprobs}], **extra}) + "\n\n"

    started = finished = None
    try:
        if not call.text:
            yield chunk({"role": "assistant", "content": ""})
        async for event in events(job):
            started, finished = _note(event, started, finished, answer)
            if event.kind == "step" and event.phase == "main" and not answer.stopped:
                delta = answer.add(event.data)
                if delta:
                    yield chunk({"content": delta})
                if answer.stopped:
                    job.cancel()
            elif event.kind == "prefill" and event.phase == "main":  # a comment: keeps proxies waiting, no data
                yield f": reading the prompt, {event.data.done}/{event.data.total} tokens\n\n"
            elif event.kind == "error":
                yield "data: " + json.dumps(_failure(str(event.data)).body()) + "\n\n"
                return
            elif event.kind == "cancelled" and not answer.stopped:
                yield "data: " + json.dumps(_failure("the request was cancelled").body()) + "\n\n"
                return
            elif event.kind in ("done", "cancelled"):
                break
        rest = answer.flush()
        if rest:
            yield chunk({"content": rest})
        yield chunk({}, _finish_reason(answer, finished), sequoia=speculation(answer, started, finished))
        if call.include_usage:
            yield "data: " + json.dumps({**base, "choices": [], "usage": _usage(call, answer)}) + "\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if not job.finished:
            job.cancel()


# ----- routes ----------------------------------------------------------------------------------
def client_key(host: str | None) -> str:
    """Whom a call counts against in the queue: its IPv4 address, or its IPv6 address's /64 (one
    machine holds a whole /64; an IPv4-mapped address counts as the IPv4 one)."""
    try:
        address = ipaddress.ip_address(host or "")
    except ValueError:
        return f"api:{host or 'unknown'}"
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return f"api:{address.ipv4_mapped}"
        return f"api:{ipaddress.IPv6Network((address, 64), strict=False)}"
    return f"api:{address}"


def bearer_check(api_key: str | None):
    """A dependency that refuses (401, OpenAI's shape) requests without ``Authorization: Bearer
    <api_key>``; with no key, every request passes."""

    async def check(http: Request) -> None:
        if api_key is None:
            return
        scheme, _, given = http.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), api_key.encode()):
            raise APIError(401, "a valid API key is required: send 'Authorization: Bearer <key>' (the server's "
                           "--api-key)", code="invalid_api_key", kind="authentication_error")

    return check


def routes(worker: Worker, defaults: dict | None = None, api_key: str | None = None) -> FastAPI:
    """A FastAPI sub-application with the two endpoints (mounted by :func:`mount`), behind
    ``api_key`` when one is given."""
    defaults = dict(defaults or {})
    api = FastAPI(title="Sequoia Chat OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None,
                  dependencies=[Depends(bearer_check(api_key))])

    @api.exception_handler(APIError)
    async def api_error(_request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @api.get("/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": model_id(worker), "object": "model", "created": 0,
                                            "owned_by": OWNER}]}

    @api.post("/chat/completions")
    async def chat_completions(http: Request) -> Response:
        return await answer(http, parse_chat)

    @api.post("/completions")
    async def completions(http: Request) -> Response:
        return await answer(http, parse_completion)

    async def answer(http: Request, parse) -> Response:
        try:
            media_type = http.headers.get("content-type", "").split(";")[0].strip().lower()
            if media_type != "application/json":  # a web page's "simple" cross-site POST cannot send this
                raise APIError(415, f"the request body must be sent as application/json (got {media_type or 'none'!r})",
                               code="unsupported_media_type")
            body = parse_body(await read_body(http))
            call = await anyio.to_thread.run_sync(parse, body, worker, defaults, limiter=API_WAITERS)
            client = client_key(http.client.host if http.client else None)
            if call.request.cache_key:  # a 'user' names a conversation of this client's, never another's
                call.request.cache_key = f"{client}|{call.request.cache_key}"
            job = submit(worker, call, client)
            if call.stream:
                return StreamingResponse(stream(worker, call, job), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            try:
                return JSONResponse(await complete(worker, call, job, http))
            finally:
                if not job.finished:
                    job.cancel()
        except APIError as error:
            return error.response()
        except ClientDisconnect:  # gone, or cut off (app.server_limits), before its body ended: no one to answer
            return Response(status_code=400)

    @api.exception_handler(Exception)
    async def internal(_request: Request, error: Exception) -> JSONResponse:
        log.exception("an API request failed")
        return APIError(500, f"the server failed on this request ({type(error).__name__})", code="internal_error",
                        kind="server_error").response()

    @api.exception_handler(404)
    async def not_found(_request: Request, _exc) -> JSONResponse:
        return APIError(404, "unknown endpoint: this server has /v1/models, /v1/chat/completions and /v1/completions",
                        code="not_found").response()

    @api.exception_handler(405)
    async def not_allowed(request: Request, _exc) -> JSONResponse:
        return APIError(405, f"{request.method} is not allowed here", code="method_not_allowed").response()

    return api


def mount(app: FastAPI, worker: Worker, defaults: dict | None = None, api_key: str | None = None) -> None:
    """Serve the endpoints under ``/v1`` of ``app`` (the Gradio app's FastAPI server), ahead of its
    own routes; ``defaults``: the tree used when a request does not say (``tree_size``, ``depth``);
    ``api_key``: the Bearer token every request must carry (none: open, for loopback use)."""
    app.mount("/v1", routes(worker, defaults, api_key))
    app.router.routes.insert(0, app.router.routes.pop())
