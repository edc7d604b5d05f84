"""The OpenAI-shaped requests the API (:mod:`app.api.openai_api`) accepts, checked before anything
runs: a JSON body within its size, then the chat or text completion it asks for as a
:class:`ChatCall` (a worker request, the model, stream options, stop strings), or an
:class:`APIError` in OpenAI's error shape that names the field at fault."""
from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass, field
from pathlib import PurePath

from fastapi import Request
from fastapi.responses import JSONResponse
from jinja2 import TemplateError

from app.views.conversation import MAX_IMPORT_MESSAGES, MAX_MESSAGE_CHARS, ContextTooLong, fit_context
from app.serving.jobs import GenerationRequest
from app.serving.worker import Worker
from engine.core.logprobs import MAX_TOP_LOGPROBS
from engine.core.settings import AUTO, METHODS, TreeSize, TreeSpec, settings_from
from engine.errors import EngineError

DEFAULT_MAX_TOKENS = 1024     # a request that names no max_tokens (the rest of the context when less)
MAX_TOKENS_LIMIT = 4096       # the most a request may ask for (launch.py --max-tokens-limit)
MAX_STOPS = 4
MAX_STOP_CHARS = 256           # each stop string; the hold-back check is quadratic in its length
MAX_BODY_BYTES = 8 << 20       # a request body
MAX_TOTAL_CHARS = 2_000_000    # all messages together (the longest context is far shorter)
MAX_TREE_SIZE = 128
MAX_PREDICTION_CHARS = 400_000  # an expected answer (Predicted Outputs)
MAX_LEGACY_LOGPROBS = 5        # /v1/completions' ``logprobs``, as OpenAI's


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
    prediction_tokens: int = 0  # tokens of the request's ``prediction`` (OpenAI's Predicted Outputs)
    logprobs: int | None = None  # alternatives per token when logprobs were asked for (None: not asked)


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


def _unicode(text: str, param: str) -> str:
    """``text``, refused (400 naming ``param``) when it holds a lone UTF-16 surrogate: JSON can
    carry one (``"\\ud800"``), UTF-8 cannot, and the tokenizer fails on it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(400, f"'{param}' is not valid Unicode text: a lone surrogate "
                            f"{text[exc.start]!r} at character {exc.start}", param, "invalid_value") from None
    return text


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
    return _unicode(text, f"messages[{index}].content")


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


def parse_tree(options, worker: Worker, defaults: dict) -> tuple[TreeSpec, str]:
    """``(tree spec, method)`` from the ``sequoia`` extension field; by default the UI's initial
    tree: the optimizer's pick where the pair has one (``auto``), else the size and depth of
    ``defaults``. The tree itself is the worker's decision, as for the UI's same controls."""
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
    sized = "tree_size" in options or "depth" in options
    auto = options.get("auto", defaults.get("auto", True) and not sized and worker.tuner is not None)
    if not isinstance(auto, bool):
        raise APIError(400, "'sequoia.auto' must be true or false", "sequoia.auto", "invalid_value")
    if auto:
        if worker.tuner is None:
            raise APIError(400, "'sequoia.auto' needs a calibration and hardware profile for this pair",
                           "sequoia.auto", "invalid_value")
        return AUTO, method
    size = _integer(options.get("tree_size", defaults.get("tree_size", 8)), "sequoia.tree_size", 1, MAX_TREE_SIZE)
    depth = _integer(options.get("depth", min(defaults.get("depth", 4), max(1, size - 1))), "sequoia.depth", 1,
                     max(1, size - 1))
    return (None if method == "autoregressive" else TreeSize(size, depth)), method


def parse_chat(body, worker: Worker, defaults: dict) -> ChatCall:
    """Validate a ``/v1/chat/completions`` body against the pair in use; raises :class:`APIError`."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = body.get("model")
    served = model_id(worker)
    if model is not None and model != served:
        raise APIError(404, f"the model {model!r} does not exist: this server serves {served!r} (GET /v1/models)",
                       "model", "model_not_found")
    for name, allowed in (("tools", None), ("functions", None), ("tool_choice", "none"),
                          ("frequency_penalty", 0), ("presence_penalty", 0),
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
    ceiling = int(defaults.get("max_tokens_limit", MAX_TOKENS_LIMIT))
    if max_tokens is not None and _integer(max_tokens, "max_tokens", 1) > ceiling:
        raise APIError(400, f"'max_tokens' must be at most {ceiling} on this server (its --max-tokens-limit), "
                            f"got {max_tokens}", "max_tokens", "invalid_value")
    seed = body.get("seed")  # none given: a fresh one, so sampled answers differ from call to call
    seed = secrets.randbelow(2 ** 31) if seed is None else _integer(seed, "seed", -(2 ** 63), 2 ** 63 - 1)
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > 256):
        raise APIError(400, "'user' must be a string of at most 256 characters", "user", "invalid_value")
    tree, method = parse_tree(body.get("sequoia"), worker, defaults)
    prediction = parse_prediction(body.get("prediction"))
    logprobs = parse_logprobs(body.get("logprobs"), body.get("top_logprobs"))
    try:
        settings = settings_from(max_new_tokens=max_tokens or 1, temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                                 top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True), tree=tree, seed=seed,
                                 method=method, logprobs=logprobs)
        worker.decide(settings)  # the tree is decided now: a size the pair cannot build is refused here
    except EngineError as exc:
        raise APIError(400, str(exc), "sequoia", "invalid_value") from None
    request = GenerationRequest(settings=settings, prediction=prediction, system=system, messages=history,
                                cache_key=f"api-user:{user}" if user else None)
    call = ChatCall(request, served, bool(stream), bool(stream_options.get("include_usage")),
                    parse_stops(body.get("stop")), logprobs=logprobs)
    room = worker.context_limit(settings)
    try:  # refuse what does not fit now, rather than dropping turns as the UI does
        ids, dropped = fit_context(worker.tokenizer, system, history, room)
        if max_tokens is None:  # the default, or the rest of the context where less is left
            default = min(int(defaults.get("max_tokens", DEFAULT_MAX_TOKENS)), ceiling)
            budget = default if room is None else min(default, room + 1 - len(ids))
            if budget < 1:
                raise ContextTooLong(f"the messages fill the model's context ({len(ids)} tokens): nothing is left "
                                     f"to answer with")
            request.settings = settings_from(settings, max_new_tokens=budget)
    except ContextTooLong as exc:
        raise APIError(400, str(exc), "messages", "context_length_exceeded") from None
    except TemplateError as exc:
        raise APIError(400, f"the model's chat template refused these messages: {exc}", "messages",
                       "invalid_value") from None
    if dropped:
        raise APIError(400, f"the conversation does not fit the model's context with max_tokens={request.settings.max_new_tokens}: "
                            f"shorten it or lower max_tokens", "messages", "context_length_exceeded")
    call.prompt_tokens = len(ids)
    if prediction:
        call.prediction_tokens = len(worker.tokenizer.encode(prediction, add_special_tokens=False))
    return call


def parse_logprobs(wanted, top) -> int | None:
    """Chat's ``logprobs`` (true or false) and ``top_logprobs`` (0..20, only with ``logprobs``
    true): the alternatives to report per token, or None when no logprobs are asked for."""
    if wanted is not None and not isinstance(wanted, bool):
        raise APIError(400, f"'logprobs' must be true or false, got {wanted!r}", "logprobs", "invalid_value")
    if top is not None and not wanted:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
    if not wanted:
        return None
    return 0 if top is None else _integer(top, "top_logprobs", 0, MAX_TOP_LOGPROBS)


def parse_prediction(value) -> str | None:
    """OpenAI's Predicted Outputs: ``{"type": "content", "content": str | [text parts]}``, the text
    the answer is expected to repeat (a file given back with a change). It is copied from as a free
    branch of each step's tree; the answer stays exactly the target's."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") != "content" or "content" not in value:
        raise APIError(400, "'prediction' must be {\"type\": \"content\", \"content\": ...}", "prediction",
                       "invalid_value")
    content = value["content"]
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    text = content if isinstance(content, str) else None
    if text is None:
        raise APIError(400, "'prediction.content' must be a string or a list of text parts", "prediction",
                       "invalid_value")
    if len(text) > MAX_PREDICTION_CHARS:
        raise APIError(400, f"'prediction.content' is longer than {MAX_PREDICTION_CHARS:,} characters", "prediction",
                       "invalid_value")
    return _unicode(text, "prediction.content") or None


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
    _unicode(prompt, "prompt")
    text_only = {"suffix": None, "best_of": 1, "echo": False}  # the one harmless value of each
    for name, harmless in text_only.items():
        if body.get(name) not in (None, harmless):
            raise APIError(400, f"'{name}' is not supported by this server", name, "unsupported_parameter")
    legacy = body.get("logprobs")  # alternatives per token, 0..5; the chosen token's logprob always comes too
    logprobs = None if legacy is None else _integer(legacy, "logprobs", 0, MAX_LEGACY_LOGPROBS)
    chat_shaped = {k: v for k, v in body.items() if k not in ("prompt", "logprobs") and k not in text_only}
    chat_shaped["messages"] = [{"role": "user", "content": "-"}]
    chat_shaped.setdefault("max_tokens", 16)
    try:
        call = parse_chat(chat_shaped, worker, defaults)  # every other field means the same
    except APIError as error:  # max_tokens leaves no room (or a few tokens) beside it: the prompt's fault
        if error.code != "context_length_exceeded":
            raise
        wanted = chat_shaped.get("max_completion_tokens", chat_shaped.get("max_tokens"))
        raise APIError(400, f"max_tokens={wanted} leaves the prompt no room in the model's context", "prompt",
                       "context_length_exceeded") from None
    ids = prompt_ids(worker.tokenizer, prompt)
    request = call.request
    request.messages, request.system, request.input_ids, request.cache_key = None, None, ids, None
    request.settings = settings_from(request.settings, logprobs=logprobs)
    limit = worker.context_limit(request.settings)
    if limit is not None and len(ids) > limit:
        raise APIError(400, f"the prompt is {len(ids)} tokens; with max_tokens={request.settings.max_new_tokens} at most "
                            f"{limit} fit the model's context", "prompt", "context_length_exceeded")
    call.text, call.prompt_tokens = True, len(ids)
    call.logprobs = logprobs
    return call


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """A text completion's prompt as its model reads text: the prompt's own tokens, after the BOS
    token where the model's file adds one (Gemma, Llama 3; llama.cpp's server does the same), not
    twice when the prompt already starts with it; no chat template, nothing else added."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    if bos is not None and ids[:1] != [bos] and tokenizer(prompt)["input_ids"][:1] == [bos]:
        ids = [bos, *ids]
    return ids


def model_id(worker: Worker) -> str:
    """The id this server answers to: the target of the pair in use (a local folder or GGUF file by
    its name only: the server's paths are nobody's business)."""
    target = str(worker.info.get("target") or "sequoia")
    if target.startswith(("/", "~", ".")) or "\\" in target or target.count("/") > 1 or target.lower().endswith(".gguf"):
        return PurePath(target.replace("\\", "/")).name or "sequoia"
    return target


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
