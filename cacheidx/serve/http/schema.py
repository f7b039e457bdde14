"""The requests the server takes, as pydantic models of OpenAI's, and OpenAI's error object.

Laws:

1. A field OpenAI's API defines is either served (its range checked here: a value outside it
   is answered 422 naming the field) or refused with 400 naming the field and why
   (:data:`REFUSED`); a field it does not define is ignored, as OpenAI's own server ignores
   it, except the extensions named here (``top_k``, ``min_p``, ``return_token_ids``).
2. A request's sampling is OpenAI's: ``temperature`` 1 where unsaid (0 is greedy), ``top_p``
   1, no penalties; ``seed`` any 64-bit integer (a negative one taken modulo 2**64, so
   every value OpenAI's clients send is one seed); :func:`sampling` maps them onto the
   engine's :class:`~cacheidx.serve.sampling.Sampling`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..sampling import Sampling

__all__ = ["REFUSED", "ChatRequest", "CompletionRequest", "error", "refused", "sampling"]

#: the most samples (``n``) and stop strings a request may ask for
MOST_N = 128
MOST_STOPS = 16

#: fields of OpenAI's API this server refuses where they ask for something, and why
REFUSED = {
    "tools": "tool calls are not served: the engine has no tool-call parser",
    "tool_choice": "tool calls are not served: the engine has no tool-call parser",
    "functions": "function calls are not served: the engine has no tool-call parser",
    "function_call": "function calls are not served: the engine has no tool-call parser",
    "response_format": "only text is served: the engine has no constrained decoding",
    "logit_bias": "the engine's sampler takes no per-token bias",
    "audio": "only text is served",
    "modalities": "only text is served",
    "prediction": "predicted outputs are not served (no speculative decoding)",
    "web_search_options": "no web search",
    "echo": "the prompt is not echoed back",
    "suffix": "no insertion: the engine only continues a prompt",
    "best_of": "best_of is not served: ask for n samples and choose among them",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Message(BaseModel):
    """One message of a chat: its role and its text (a string, or text parts)."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str
    n: int = Field(1, ge=1, le=MOST_N)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extensions (vLLM's names): the engine's other filters, and the chosen ids themselves
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    return_token_ids: bool = False
    # refused where they ask for something (law 1)
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None


class ChatRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None


class CompletionRequest(_Common):
    """``POST /v1/completions``: ``prompt`` a string, token ids, or a list of either (each
    prompt its own ``n`` choices)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None


def refused(body: _Common) -> tuple[str, str] | None:
    """Law 1: ``(field, why)`` of the first field ``body`` sets that the server refuses."""
    for name, why in REFUSED.items():
        if name not in type(body).model_fields:
            continue
        value = getattr(body, name)
        if name == "response_format" and (value is None or value == {"type": "text"}):
            continue
        if name == "best_of" and value in (None, 1, body.n):
            continue
        if value in (None, False, [], {}):
            continue
        return name, why
    if len(stops(body)) > MOST_STOPS:
        return "stop", f"at most {MOST_STOPS} stop strings"
    if any(not s for s in stops(body)):
        return "stop", "a stop string must not be empty"
    return None


def stops(body: _Common) -> tuple[str, ...]:
    return (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())


def max_tokens(body: _Common) -> int | None:
    """The most tokens a choice may have: ``max_completion_tokens``, else ``max_tokens``."""
    return getattr(body, "max_completion_tokens", None) or body.max_tokens


def sampling(body: _Common) -> Sampling:
    """Law 2: the engine's sampling of ``body``'s fields."""
    if isinstance(body, ChatRequest):
        k = (body.top_logprobs or 0) if body.logprobs else None
    else:
        k = body.logprobs
    top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
    return Sampling(temperature=1.0 if body.temperature is None else body.temperature,
                    top_k=top_k, top_p=1.0 if body.top_p is None else body.top_p,
                    min_p=body.min_p or 0.0,
                    presence_penalty=body.presence_penalty or 0.0,
                    frequency_penalty=body.frequency_penalty or 0.0,
                    seed=None if body.seed is None else body.seed % 2**64,
                    logprobs=k, stop=stops(body))


def text_of(message: Message) -> str:
    """A message's text: its string, or its text parts joined. ``ValueError`` naming the
    part for one that is no text (an image, audio)."""
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    out = []
    for k, part in enumerate(message.content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"content part {k} is of type {part.get('type')!r}: only text "
                             "is served")
        out.append(part["text"])
    return "".join(out)


def error(message: str, kind: str = "invalid_request_error", param: str | None = None,
          code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
