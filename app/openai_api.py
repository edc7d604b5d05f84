"""OpenAI-compatible endpoints on the app's own server: ``GET /v1/models`` and
``POST /v1/chat/completions`` (whole answers, or streamed as server-sent events).

Requests join the same worker queue as the browser tabs, so the API and the UI share the one
engine fairly (first come, first served). Bad input is answered with OpenAI's error shape,
``{"error": {"message", "type", "param", "code"}}``, and a 4xx status before anything runs.

Honoured: ``model`` (the pair's target id), ``messages`` (system/developer anywhere, user, assistant;
text content), ``temperature`` (default 1, as OpenAI's; 0 is greedy and exact), ``top_p``,
``max_tokens`` / ``max_completion_tokens`` (default: the rest of the context), ``seed`` (default: a
fresh one), ``stop`` (up to 4 strings, cut from the text),
``stream`` and ``stream_options.include_usage``, ``n`` (1 only) and ``user`` (a conversation key:
requests with the same ``user`` reuse one conversation KV cache, like a browser session).
An extension field ``sequoia`` picks the tree: ``{"tree_size", "depth", "method", "auto"}``.

Every answer carries ``sequoia``: the tree (size, depth, parents), method, steps, tokens/step,
accepted and drafted tokens, acceptance rate, prefill/decode/first-token seconds and the prompt
tokens reused from the conversation cache (in the last chunk when streaming).
"""
from __future__ import annotations

import json
import logging
import math
import queue
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import PurePath

import anyio
from jinja2 import TemplateError
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from app.conversation import MAX_IMPORT_MESSAGES, MAX_MESSAGE_CHARS, ContextTooLong, fit_context
from app.worker import TERMINAL, Event, GenerationRequest, Job, QueueFull, Worker
from engine.core.speculative import METHODS
from engine.trees.tree import Tree
from engine.tuning.tree_store import build_tree

DEFAULT_MAX_TOKENS = 256
# Threads that wait on jobs' events for the API, apart from the pool Gradio's handlers (Stop and
# Clear included) draw from: however many API calls wait, the UI keeps its threads.
API_WAITERS = anyio.CapacityLimiter(8)
DISCONNECT_CHECK_S = 0.25  # how often a whole answer's wait asks whether its client is still there
MAX_STOPS = 4
MAX_STOP_CHARS = 256           # each stop string; the hold-back check is quadratic in its length
MAX_BODY_BYTES = 8 << 20       # a request body
MAX_TOTAL_CHARS = 2_000_000    # all messages together (the longest context is far shorter)
MAX_TREE_SIZE = 128
OWNER = "sequoia-chat"
log = logging.getLogger(__name__)


class APIError(Exception):
    """An error answered in OpenAI's shape with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


@dataclass
class ChatCall:
    """A validated chat completion request (or, with ``text``, a legacy text completion)."""

    request: GenerationRequest
    model: str
    stream: bool = False
    include_usage: bool = False
    stops: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    text: bool = False  # /v1/completions: the prompt as given, answers as "text_completion" objects


# ----- validation ----------------------------------------------------------------------------
def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value > high or value < low or (low_open and value == low):
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise APIError(400, f"'{name}' must be a number in {bound}, got {value!r}", name, "invalid_value")
    return float(value)


def _integer(value, name: str, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise APIError(400, f"'{name}' must be an integer {bound}, got {value!r}", name, "invalid_value")
    return value


def _text(content, index: int) -> str:
    """A message's text: a string, or a list of ``{"type": "text", "text"}`` parts."""
    if isinstance(content, str):
        text = content
    elif isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                           and isinstance(p.get("text"), str) for p in content):
        text = "".join(p["text"] for p in content)
    else:
        raise APIError(400, f"messages[{index}].content must be text (a string or a list of text parts)",
                       f"messages[{index}].content", "invalid_value")
    if len(text) > MAX_MESSAGE_CHARS:
        raise APIError(400, f"messages[{index}] is longer than {MAX_MESSAGE_CHARS} characters",
                       f"messages[{index}].content", "invalid_value")
    return text


def parse_messages(messages) -> tuple[str | None, list[dict]]:
    """``(system prompt, history)``: the system (or developer) messages before the first turn make
    the system prompt; later ones stay in the history as ``system`` turns, where the chat template
    places them."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list of {role, content} objects", "messages",
                       "invalid_value")
    if len(messages) > MAX_IMPORT_MESSAGES:
        raise APIError(400, f"{len(messages)} messages; at most {MAX_IMPORT_MESSAGES} are accepted", "messages",
                       "invalid_value")
    system, history = [], []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise APIError(400, f"messages[{i}] must be an object with 'role' and 'content'", f"messages[{i}]",
                           "invalid_value")
        role = message["role"]
        if role in ("system", "developer") and not history:
            system.append(_text(message["content"], i))
        elif role in ("system", "developer"):  # later instructions stay where they were given
            history.append({"role": "system", "content": _text(message["content"], i)})
        elif role in ("user", "assistant"):
            history.append({"role": role, "content": _text(message["content"], i)})
        else:
            raise APIError(400, f"messages[{i}] has role {role!r}; accepted: system, developer, user, assistant",
                           f"messages[{i}].role", "invalid_value")
    if not history or history[-1]["role"] != "user":
        raise APIError(400, "the last message must come from the user", "messages", "invalid_value")
    total = sum(len(m["content"]) for m in history) + sum(len(s) for s in system)
    if total > MAX_TOTAL_CHARS:
        raise APIError(400, f"the messages hold {total} characters; at most {MAX_TOTAL_CHARS} are accepted",
                       "messages", "context_length_exceeded")
    return ("\n\n".join(system) or None), history


def parse_stops(value) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or \
            not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise APIError(400, f"'stop' must be a string of 1 to {MAX_STOP_CHARS} characters or a list of up to "
                            f"{MAX_STOPS} of them", "stop", "invalid_value")
    return stops


def parse_tree(options, worker: Worker, defaults: dict) -> tuple[Tree | str | None, str]:
    """``(tree, method)`` from the ``sequoia`` extension field (the UI's initial tree by default)."""
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise APIError(400, "'sequoia' must be an object: {tree_size, depth, method, auto}", "sequoia",
                       "invalid_value")
    unknown = set(options) - {"tree_size", "depth", "method", "auto"}
    if unknown:
        raise APIError(400, f"unknown 'sequoia' option(s): {', '.join(sorted(unknown))}", "sequoia",
                       "invalid_value")
    method = options.get("method", "sequoia")
    if method not in METHODS:
        raise APIError(400, f"'sequoia.method' must be one of {', '.join(METHODS)}, got {method!r}",
                       "sequoia.method", "invalid_value")
    if not isinstance(options.get("auto", False), bool):
        raise APIError(400, "'sequoia.auto' must be true or false", "sequoia.auto", "invalid_value")
    if options.get("auto", False):
        if worker.tuner is None:
            raise APIError(400, "'sequoia.auto' needs a calibration and hardware profile for this pair",
                           "sequoia.auto", "invalid_value")
        return "auto", method
    size = _integer(options.get("tree_size", defaults.get("tree_size", 8)), "sequoia.tree_size", 1, MAX_TREE_SIZE)
    depth = _integer(options.get("depth", min(defaults.get("depth", 4), max(1, size - 1))), "sequoia.depth", 1,
                     max(1, size - 1))
    if method == "autoregressive" or size == 1:
        return None, method
    return (Tree.chain(depth) if method == "chain" else build_tree(size, depth)), method


def parse_chat(body, worker: Worker, defaults: dict) -> ChatCall:
    """Validate a ``/v1/chat/completions`` body against the pair in use; raises :class:`APIError`."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = body.get("model")
    served = model_id(worker)
    if model is not None and model != served:
        raise APIError(404, f"the model {model!r} does not exist: this server serves {served!r} (GET /v1/models)",
                       "model", "model_not_found")
    for name, allowed in (("tools", None), ("functions", None), ("tool_choice", "none"), ("logprobs", False),
                          ("top_logprobs", None), ("frequency_penalty", 0), ("presence_penalty", 0),
                          ("logit_bias", {}), ("response_format", {"type": "text"})):
        if body.get(name) not in (allowed, None):  # refused, never silently ignored
            raise APIError(400, f"'{name}' is not supported by this server (the answer would not honour it)",
                           name, "unsupported_parameter")
    if body.get("n") not in (None, 1):
        raise APIError(400, "'n' must be 1: one answer per request", "n", "unsupported_parameter")
    system, history = parse_messages(body.get("messages"))
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise APIError(400, "'stream' must be true or false", "stream", "invalid_value")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise APIError(400, "'stream_options' must be an object", "stream_options", "invalid_value")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = None if max_tokens is None else _integer(max_tokens, "max_tokens", 1)
    seed = body.get("seed")  # none given: a fresh one, so sampled answers differ from call to call
    seed = secrets.randbelow(2 ** 31) if seed is None else _integer(seed, "seed", -(2 ** 63), 2 ** 63 - 1)
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > 256):
        raise APIError(400, "'user' must be a string of at most 256 characters", "user", "invalid_value")
    tree, method = parse_tree(body.get("sequoia"), worker, defaults)
    request = GenerationRequest(max_new_tokens=max_tokens or 0, temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                                top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True), tree=tree, seed=seed,
                                method=method, system=system, messages=history,
                                cache_key=f"api-user:{user}" if user else None)
    call = ChatCall(request, served, bool(stream), bool(stream_options.get("include_usage")),
                    parse_stops(body.get("stop")))
    try:  # refuse what does not fit now, rather than dropping turns as the UI does
        ids, dropped = fit_context(worker.tokenizer, system, history, worker.context_limit(request))
        if max_tokens is None:  # the rest of the context, as llama-server does (a model with none stated: 256)
            room = worker.context_limit(request)
            request.max_new_tokens = DEFAULT_MAX_TOKENS if room is None else room - len(ids)
            if request.max_new_tokens < 1:
                raise ContextTooLong(f"the messages fill the model's context ({len(ids)} tokens): nothing is left "
                                     f"to answer with")
    except ContextTooLong as exc:
        raise APIError(400, str(exc), "messages", "context_length_exceeded") from None
    except TemplateError as exc:
        raise APIError(400, f"the model's chat template refused these messages: {exc}", "messages",
                       "invalid_value") from None
    if dropped:
        raise APIError(400, f"the conversation does not fit the model's context with max_tokens={request.max_new_tokens}: "
                            f"shorten it or lower max_tokens", "messages", "context_length_exceeded")
    call.prompt_tokens = len(ids)
    return call


def parse_completion(body, worker: Worker, defaults: dict) -> ChatCall:
    """Validate a ``/v1/completions`` body: ``prompt`` (a string, or a list of one) is continued as
    given, no chat template; ``max_tokens`` defaults to 16 as in OpenAI's API."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt or len(prompt) > MAX_TOTAL_CHARS:
        raise APIError(400, f"'prompt' must be one non-empty string of at most {MAX_TOTAL_CHARS} characters",
                       "prompt", "invalid_value")
    text_only = {"suffix": None, "logprobs": None, "best_of": 1, "echo": False}  # the one harmless value of each
    for name, harmless in text_only.items():
        if body.get(name) not in (None, harmless):
            raise APIError(400, f"'{name}' is not supported by this server", name, "unsupported_parameter")
    chat_shaped = {k: v for k, v in body.items() if k != "prompt" and k not in text_only}
    chat_shaped["messages"] = [{"role": "user", "content": "-"}]
    chat_shaped.setdefault("max_tokens", 16)
    call = parse_chat(chat_shaped, worker, defaults)  # every other field means the same
    ids = worker.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    request = call.request
    request.messages, request.system, request.input_ids, request.cache_key = None, None, ids, None
    limit = worker.context_limit(request)
    if limit is not None and len(ids) > limit:
        raise APIError(400, f"the prompt is {len(ids)} tokens; with max_tokens={request.max_new_tokens} at most "
                            f"{limit} fit the model's context", "prompt", "context_length_exceeded")
    call.text, call.prompt_tokens = True, len(ids)
    return call


def model_id(worker: Worker) -> str:
    """The id this server answers to: the target of the pair in use (a local folder by its name
    only: the server's paths are nobody's business)."""
    target = str(worker.info.get("target") or "sequoia")
    if target.startswith(("/", "~", ".")) or "\\" in target or target.count("/") > 1:
        return PurePath(target.replace("\\", "/")).name or "sequoia"
    return target


# ----- answers -------------------------------------------------------------------------------
class Answer:
    """A job's committed tokens as text: stop strings cut it, and streamed deltas never show part
    of a stop string or of a character still being spelled by byte tokens."""

    def __init__(self, tokenizer, stops: list[str]) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.tokens: list[int] = []
        self.records: list = []
        self.text = ""
        self.sent = 0
        self.stopped = False  # a stop string was found

    def add(self, record) -> str:
        """Take one step's record; the text that may be sent now."""
        self.records.append(record)
        self.tokens.extend(record.committed)
        self.text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
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
        return delta


def speculation(answer: Answer, started: dict | None, finished: dict | None) -> dict:
    """The ``sequoia`` field: the tree, method and how speculation went."""
    steps = answer.records
    drafted = sum(len(s.tokens) - 1 for s in steps)
    accepted = sum(s.accepted_draft_tokens for s in steps)
    tokens = sum(len(s.committed) for s in steps)
    tree = (started or {}).get("tree")
    choice = (started or {}).get("tree_choice")
    finished = finished or {}
    return {
        "method": steps[0].method if steps else None,
        "tree": {"size": tree.size, "depth": tree.depth, "parents": list(tree.parents)} if tree is not None else None,
        "auto": choice is not None,
        "steps": len(steps),
        "tokens_per_step": tokens / len(steps) if steps else 0.0,
        "accepted_draft_tokens": accepted,
        "drafted_tokens": drafted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "prefill_s": finished.get("prefill_s"),
        "decode_s": finished.get("decode_s"),
        "first_token_s": finished.get("first_token_s"),
        "reused_prompt_tokens": finished.get("reused_tokens", 0),
    }


def _usage(call: ChatCall, answer: Answer) -> dict:
    completion = len(answer.tokens)
    return {"prompt_tokens": call.prompt_tokens, "completion_tokens": completion,
            "total_tokens": call.prompt_tokens + completion}


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
    answer = Answer(worker.tokenizer, call.stops)
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
    choice = {"text": answer.text} if call.text else {"message": {"role": "assistant", "content": answer.text}}
    return {"id": _id(call), "object": "text_completion" if call.text else "chat.completion",
            "created": int(time.time()), "model": call.model,
            "choices": [{"index": 0, **choice, "finish_reason": _finish_reason(answer, finished), "logprobs": None}],
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
    answer = Answer(worker.tokenizer, call.stops)
    base = {"id": _id(call), "object": "text_completion" if call.text else "chat.completion.chunk",
            "created": int(time.time()), "model": call.model}

    def chunk(delta: dict, finish: str | None = None, **extra) -> str:
        part = {"text": delta.get("content", "")} if call.text else {"delta": delta}
        return "data: " + json.dumps({**base, "choices": [{"index": 0, **part, "finish_reason": finish,
                                                           "logprobs": None}], **extra}) + "\n\n"

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
async def read_body(http: Request) -> bytes:
    """The request body, refused (413) past ``MAX_BODY_BYTES`` whether or not it says its length."""
    too_big = APIError(413, f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB", code="request_too_large")
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_big
    body = bytearray()
    async for part in http.stream():
        body += part
        if len(body) > MAX_BODY_BYTES:
            raise too_big
    return bytes(body)


def parse_body(body: bytes) -> dict:
    """The JSON object of a request body (400 for anything else, deep nesting included)."""
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise APIError(400, "the request body is not valid JSON (or nests too deeply)") from None
    if not isinstance(value, dict):
        raise APIError(400, "the request body must be a JSON object")
    return value


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
            client = f"api:{http.client.host if http.client else 'unknown'}"
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
