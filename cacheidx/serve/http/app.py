"""The routes: OpenAI's chat and completion endpoints over one :class:`~.loop.Loop`, and
``/v1/models``, ``/health``, ``/metrics``.

Laws:

1. A request is answered by OpenAI's objects: ``chat.completion`` (or, streamed, one
   ``chat.completion.chunk`` event per step that moved it, then ``data: [DONE]``) and
   ``text_completion``. A stream's first event of each choice gives its role; its last, its
   ``finish_reason``; with ``stream_options.include_usage`` one more event, of no choices,
   gives the usage, which every other event says is ``null``.
2. A choice's text is the detokenized continuation without the model's stop tokens, cut
   before the first stop string (the sampling's law 6); a stream shows at each step only the
   text that no later token or stop string can change (:class:`~cacheidx.serve.text.Text`),
   so its deltas joined are the whole answer's text. ``finish_reason`` is ``"stop"`` where
   a stop token or string ended it, ``"length"`` where ``max_tokens`` did.
3. ``usage``: ``prompt_tokens`` each prompt once, ``completion_tokens`` every choice's
   tokens, and ``prompt_tokens_details.cached_tokens`` the prompt tokens read from the prefix
   cache by the sample that read the fewest (the one that computed the prompt for the
   others), each prompt's summed.
4. Each bad request is answered alone, with OpenAI's error object: 400 for a body that is no
   JSON, a field refused (:data:`~.schema.REFUSED`) or a prompt the engine can never serve
   (past the model's context or the pool); 422 for a field of the wrong type or out of
   range; 404 for an unknown model or path; 429 past the queue's limit; 503 while the
   server drains or where its engine broke; 500 for anything else. The server goes on.
5. A client that disconnects cancels its request (streamed or not): its pages are freed
   before the engine's next step (the loop's law 3).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from ..engine import CANCELLED
from ..requests import Request
from ..sampling import cut
from ..text import Text
from . import schema
from .loop import Draining, Full, Job, Loop
from .metrics import CONTENT_TYPE, Metrics
from .schema import ChatRequest, CompletionRequest, error

__all__ = ["app"]

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


class Refusal(Exception):
    """A request answered with an error (law 4)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, error(message, kind, param, code)


def app(loop: Loop, *, name: str, template: Callable[[list[dict]], list[int]],
        decode: Callable[[list[int]], str] | None, encode: Callable[[str], list[int]] | None,
        stop: Sequence[int] = (), max_tokens: int = 256, context: int | None = None) -> FastAPI:
    """The server of ``loop``'s engine, serving the model ``name``: ``template`` makes a
    chat's prompt ids, ``encode`` a completion's text prompt's (``None``: prompts of token
    ids only), ``decode`` the answer's text (``None``: empty text, the ids through
    ``return_token_ids``); ``stop`` are the ids that end a turn; ``max_tokens`` the tokens a
    choice may have where the request does not say."""
    api = FastAPI(title="cacheidx", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = Metrics()
    stop = frozenset(int(t) for t in stop)
    created = int(time.time())
    api.state.loop, api.state.metrics = loop, metrics

    api.add_middleware(Counting, metrics=metrics)

    @api.exception_handler(Refusal)
    async def refusal(_: HTTPRequest, e: Refusal) -> JSONResponse:
        return JSONResponse(e.body, status_code=e.status)

    async def parsed(request: HTTPRequest, model: type[BaseModel]) -> Any:
        """The body as ``model`` (law 4: 400 for no JSON, 422 for a field it refuses)."""
        raw = await request.body()
        try:
            item = json.loads(raw)
        except ValueError as e:  # UnicodeDecodeError included
            raise Refusal(400, f"the body is no JSON: {e}", code="invalid_json") from None
        if not isinstance(item, dict):
            raise Refusal(400, f"the body must be a JSON object, got {type(item).__name__}",
                          code="invalid_json")
        try:
            return model.model_validate(item)
        except ValidationError as e:
            errors = e.errors()
            first = errors[0]
            param = ".".join(str(x) for x in first.get("loc", ())) or None
            message = f"{param or 'the body'}: {first.get('msg')}"
            if len(errors) > 1:
                message += f" (and {len(errors) - 1} more)"
            raise Refusal(422, message, param=param, code="invalid_value") from None

    @api.exception_handler(HTTPException)
    async def http_error(request: HTTPRequest, e: HTTPException) -> JSONResponse:
        message = (f"no route {request.method} {request.url.path}" if e.status_code == 404
                   else str(e.detail))
        return JSONResponse(error(message, code=str(e.status_code)), status_code=e.status_code)

    @api.exception_handler(Exception)
    async def crashed(_: HTTPRequest, e: Exception) -> JSONResponse:
        return JSONResponse(error(f"{type(e).__name__}: {e}", "server_error"), status_code=500)

    @api.get("/health")
    async def health() -> JSONResponse:
        if loop.broken is not None:
            return JSONResponse({"status": "broken", "error": loop.broken}, status_code=503)
        if loop.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @api.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.text(loop.snapshot), media_type=CONTENT_TYPE)

    @api.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "cacheidx",
             "max_model_len": context}]})

    def text(tokens: Sequence[int]) -> str:
        return "" if decode is None else decode([t for t in tokens if t not in stop])

    def prompts(body: ChatRequest | CompletionRequest) -> list[list[int]]:
        if body.model != name:
            raise Refusal(404, f"the model {body.model!r} does not exist; this server serves "
                          f"{name!r}", param="model", code="model_not_found")
        why = schema.refused(body)
        if why is not None:
            raise Refusal(400, f"{why[0]}: {why[1]}", param=why[0], code="unsupported")
        if isinstance(body, ChatRequest):
            try:
                messages = [{"role": m.role, "content": schema.text_of(m)}
                            for m in body.messages]
            except ValueError as e:
                raise Refusal(400, f"messages: {e}", param="messages") from None
            try:
                return [list(template(messages))]
            except Exception as e:  # the template's own failure, whatever its library raises
                raise Refusal(400, f"messages: the chat template failed: {type(e).__name__}: "
                              f"{e}", param="messages") from None
        p = body.prompt
        many = isinstance(p, list) and p and not isinstance(p[0], int)
        out = []
        for one in (p if many else [p]):
            if isinstance(one, str):
                if encode is None:
                    raise Refusal(400, f"prompt: {name} has no tokenizer: give token ids",
                                  param="prompt")
                one = list(encode(one))
            if not one:
                raise Refusal(400, "prompt: empty", param="prompt")
            out.append(list(one))
        return out

    def jobs_of(body: ChatRequest | CompletionRequest, call: str) -> list[Job]:
        ids = prompts(body)
        new = schema.max_tokens(body) or max_tokens
        try:
            sampling = schema.sampling(body)
        except (TypeError, ValueError) as e:
            raise Refusal(422, str(e), code="invalid_value") from None
        aloop, event = asyncio.get_running_loop(), asyncio.Event()
        jobs = []
        for k, prompt in enumerate(ids):
            try:
                request = Request(f"{call}/{k}", prompt, new, stop=stop, n=body.n,
                                  sampling=sampling)
            except (TypeError, ValueError) as e:
                raise Refusal(400, str(e), param="prompt") from None
            why = loop.refusal(request)
            if why is not None:
                raise Refusal(400, why, param="messages" if isinstance(body, ChatRequest)
                              else "prompt", code="context_length_exceeded")
            jobs.append(Job(request, aloop, event))
        submitted = []
        try:
            for job in jobs:
                loop.submit(job)
                submitted.append(job)
        except Full as e:
            for job in submitted:
                loop.cancel(job)
            raise Refusal(429, f"the server is busy: {e}", "rate_limit_error",
                          code="queue_full") from None
        except Draining as e:
            for job in submitted:
                loop.cancel(job)
            raise Refusal(503, str(e), "server_error", code="unavailable") from None
        return jobs

    @api.post("/v1/chat/completions")
    async def chat(request: HTTPRequest) -> Response:
        body = await parsed(request, ChatRequest)
        call = f"chatcmpl-{uuid.uuid4().hex}"
        return await answer(body, request, jobs_of(body, call), call, chat=True)

    @api.post("/v1/completions")
    async def completions(request: HTTPRequest) -> Response:
        body = await parsed(request, CompletionRequest)
        call = f"cmpl-{uuid.uuid4().hex}"
        return await answer(body, request, jobs_of(body, call), call, chat=False)

    async def answer(body: Any, request: HTTPRequest, jobs: list[Job], call: str, *,
                     chat: bool) -> Response:
        choices = [Choice(job, k, body.n * j + k) for j, job in enumerate(jobs)
                   for k in range(body.n)]
        stops = schema.stops(body)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(stream(jobs, choices, stops, call, chat, usage, body),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        if not await finished(jobs, request):
            return Response(status_code=499)  # the client is gone: no one reads this
        failed = next((job.result.error for job in jobs if job.result.error is not None), None)
        if failed is not None:
            return JSONResponse(error(failed, "server_error"), status_code=500)
        out = []
        for c in choices:
            c.settle(text, stops)
            item = {"index": c.index, "finish_reason": c.reason,
                    "logprobs": c.logprobs(decode, chat, 0, len(c.sample.tokens))}
            if chat:
                item["message"] = {"role": "assistant", "content": c.text}
            else:
                item["text"] = c.text
            if body.return_token_ids:
                item["token_ids"] = list(c.sample.tokens)
            out.append(item)
        return JSONResponse({"id": call, "object": "chat.completion" if chat
                             else "text_completion", "created": int(time.time()),
                             "model": name, "choices": out, "usage": usage_of(jobs)})

    async def finished(jobs: list[Job], request: HTTPRequest) -> bool:
        """Law 5: waits for every job's end; cancels them and says ``False`` where the client
        disconnected first."""
        async def ends() -> None:
            while not all(job.done for job in jobs):
                await jobs[0].changed()

        async def gone() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        end, left = asyncio.ensure_future(ends()), asyncio.ensure_future(gone())
        try:
            await asyncio.wait({end, left}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not end.done():
                for job in jobs:
                    loop.cancel(job)
            end.cancel()
            left.cancel()
        return all(job.done for job in jobs)

    async def stream(jobs: list[Job], choices: list[Choice], stops: tuple[str, ...],
                     call: str, chat: bool, usage: bool, body: Any) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"
        t = int(time.time())

        def event(items: list[dict], use: Any = None) -> str:
            out = {"id": call, "object": kind, "created": t, "model": name, "choices": items}
            if usage:
                out["usage"] = use
            return f"data: {json.dumps(out)}\n\n"

        try:
            if chat:
                yield event([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None} for c in choices])
            while True:
                # what has ended is read once, before the choices: a job that ends while
                # they are written is written whole by the next round, never skipped
                ended = [job.done for job in jobs]
                items = []
                for c in choices:
                    done = c.job.done
                    if c.closed or (done and c.job.result.error is not None):
                        continue
                    old_text, old_tokens = c.shown, c.tokens_sent
                    if done:
                        c.settle(text, stops)
                        delta = c.text[old_text:]
                    else:
                        delta = c.advance(decode, stops)
                    tokens = c.sample.tokens[old_tokens:c.tokens_sent]
                    if not done and not delta and not (
                            tokens and (body.return_token_ids or c.wants_logprobs)):
                        continue
                    item: dict = {"index": c.index, "logprobs": c.logprobs(
                        decode, chat, old_tokens, c.tokens_sent),
                        "finish_reason": c.reason if done else None}
                    if chat:
                        item["delta"] = {"content": delta} if delta or not done else {}
                    else:
                        item["text"] = delta
                    if body.return_token_ids:
                        item["token_ids"] = list(tokens)
                    c.closed = done
                    items.append(item)
                if items:
                    yield event(items)
                failed = next((job.result.error for job, e in zip(jobs, ended)
                               if e and job.result.error is not None), None)
                if failed is not None:
                    if failed == CANCELLED:
                        failed = "the request was cancelled: the server is shutting down"
                    yield f"data: {json.dumps(error(failed, 'server_error'))}\n\n"
                    break
                if all(ended):
                    if usage:
                        yield event([], usage_of(jobs))
                    break
                await jobs[0].changed()
            yield "data: [DONE]\n\n"
        finally:  # law 5: a client gone mid-stream cancels what still runs
            for job in jobs:
                if not job.done:
                    loop.cancel(job)

    def usage_of(jobs: list[Job]) -> dict:
        prompt = sum(len(job.request.prompt) for job in jobs)
        completion = sum(len(s.tokens) for job in jobs for s in job.samples)
        cached = sum(min(s.cached for s in job.samples) for job in jobs)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    return api


class Counting:
    """The metrics' law 1, as ASGI middleware: each answer counted as its headers go out."""

    def __init__(self, app: Any, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"] if scope["path"] in ROUTES else "other"

        async def counted(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.metrics.answered(path, message["status"])
            await send(message)

        await self.app(scope, receive, counted)


class Choice:
    """One choice of an answer: sample ``sample`` of ``job``, the answer's choice ``index``;
    what a stream has shown of it (``shown`` characters, the ``deltas`` sent, ``tokens_sent``)
    and its text read as it grows (``reader``, a :class:`~cacheidx.serve.text.Text`)."""

    def __init__(self, job: Job, sample: int, index: int):
        self.job, self.index = job, index
        self.sample = job.samples[sample]
        self.shown = 0
        self.deltas: list[str] = []
        self.reader: Text | None = None
        self.tokens_sent = 0
        self.text = ""
        self.reason: str | None = None
        self.closed = False

    def advance(self, decode: Callable[[list[int]], str] | None,
                stops: tuple[str, ...]) -> str:
        """Law 2: the text no later token can change, past what was shown (the stream's
        next delta), read from the new tokens alone (the text's law 1: a stream's cost is
        linear in its answer)."""
        n = len(self.sample.tokens)
        delta = ""
        if decode is not None:
            if self.reader is None:
                self.reader = Text(decode, stops, drop=self.job.request.stop, streamed=True)
            self.reader.extend(self.sample.tokens[self.reader.fed:n])
            delta = self.reader.take()
            self.deltas.append(delta)
            self.shown += len(delta)
        self.tokens_sent = n
        return delta

    def settle(self, text: Callable[[Sequence[int]], str], stops: tuple[str, ...]) -> None:
        """Law 2: the ended sample's text and finish reason."""
        tokens = self.sample.tokens
        self.text, found = cut(text(tokens), stops)
        shown = "".join(self.deltas)
        if not self.text.startswith(shown):  # a tokenizer whose text is no prefix's
            self.text = shown + self.text[len(shown):]
        self.shown, self.deltas = len(self.text), [self.text]
        self.tokens_sent = len(tokens)
        ended = found or (tokens and tokens[-1] in self.job.request.stop)
        self.reason = "stop" if ended or len(tokens) < self.job.request.max_new_tokens \
            else "length"

    @property
    def wants_logprobs(self) -> bool:
        s = self.job.request.sampling
        return s is not None and s.logprobs is not None

    def logprobs(self, decode: Callable[[list[int]], str] | None, chat: bool, start: int,
                 end: int) -> dict | None:
        """OpenAI's log-probabilities of tokens ``start`` to ``end`` (``None`` where the
        request asked none)."""
        if not self.wants_logprobs:
            return None
        lps = self.sample.logprobs[start:end]

        def word(t: int) -> str:
            return "" if decode is None else decode([t])

        if chat:
            return {"content": [
                {"token": word(x.token), "logprob": x.logprob,
                 "bytes": list(word(x.token).encode("utf-8", "replace")),
                 "top_logprobs": [{"token": word(i), "logprob": lp,
                                   "bytes": list(word(i).encode("utf-8", "replace"))}
                                  for i, lp in x.top]} for x in lps]}
        words = [word(x.token) for x in lps]
        at = sum(len(word(x.token)) for x in self.sample.logprobs[:start])
        offsets = []
        for w in words:  # where each token's text starts in the choice's text
            offsets.append(at)
            at += len(w)
        return {"tokens": words, "token_logprobs": [x.logprob for x in lps],
                "top_logprobs": [{word(i): lp for i, lp in x.top} for x in lps],
                "text_offset": offsets}
