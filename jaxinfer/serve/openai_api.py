"""The OpenAI API on the engine, without HTTP: request bodies in, response bodies (or server-sent event
chunks) out. The server (jaxinfer.serve.server) and batch jobs (jaxinfer.serve.batch_job) both call `OpenAIServing`.

Requests are checked by pydantic models, then here, then by SamplingParams and the engine's checks; every bad
value raises `APIError` with the status and the OpenAI error body a client expects: 400 naming the field, the
value and the limit (never a 500), 404 for a model this server does not serve, 503 once the engine is dead,
and 500 (an OpenAI body) for a request that failed inside the engine.

Fields: integers must be JSON integers (not 3.0, "3" or true) and floats finite, each bounded where it reaches
the engine. A field this server does not implement is refused with a 400 naming it, not ignored: the request
models forbid unknown fields, so a typo (`max_token`) is refused rather than answered with a default, and so
are `tool_choice` (other than "none"), `functions`, `guided_json`, `min_tokens`, `suffix`, penalties,
`logit_bias`... A few OpenAI fields that do not change the output are accepted and ignored (`IGNORED`), and an
unknown field set to null counts as absent.

Log-probabilities are vLLM's: those of the distribution each token was drawn from, after temperature and
the top-k/top-p/min-p filters (a filtered-out token has -inf, reported -9999.0); the model's own for greedy
decoding. A completion's `top_logprobs` are dicts keyed by token text, most likely first; where two of a
position's tokens decode to the same text (byte fragments all decode to "\ufffd"), the likelier keeps the
text and the other is keyed `token_id:N`, vLLM's spelling of token N, so no alternative is lost. A token whose
own text looks like `token_id:N` is keyed by its id too, so such a key always means token N. vLLM's
`return_tokens_as_token_ids` spells every token (tokens, keys, chat `token`) `token_id:N`.

Prompt log-probabilities (lm-evaluation-harness's loglikelihood requests) are the model's own distribution at
each prompt position, computed in the prompt's own prefill step (SamplingParams.prompt_logprobs). A completion
with `echo` and `logprobs: k` shows the prompt then the completion, in its text and in its logprobs (the first
prompt token's `token_logprobs` and `top_logprobs` entries null, as OpenAI's); `max_tokens: 0` with `echo`
returns the prompt alone (a token is drawn and dropped, as vLLM does). vLLM's `prompt_logprobs: k` (both
endpoints, not streamed) gives its list: None, then per prompt token {"token id": {"logprob", "rank",
"decoded_token"}} for the token and the k most likely, on each completion choice and on the chat response.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from jaxinfer.engine.core import Completion, RequestError
from jaxinfer.engine.loop import EngineDead, RequestStream
from jaxinfer.llm import LLM
from jaxinfer.sampling import MAX_LOGPROBS, SEED_LIMIT, SamplingParams
from jaxinfer.tokenizer import TokenizerError

MAX_N = 64  # choices one request may ask for
IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
           "safety_identifier")   # OpenAI fields accepted without effect: none changes the output
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 503: "service_unavailable_error"}
_TOKEN_ID = re.compile(r"token_id:\d+")
_SURROGATES = " (text with lone surrogates, which the tokenizer cannot take?)"
log = logging.getLogger("jaxinfer")


class APIError(Exception):
    """A request the server refuses (or that failed): the HTTP status and the OpenAI error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    @property
    def type(self) -> str:
        return ERROR_TYPES.get(self.status, "internal_server_error")

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def of_validation(cls, e: ValidationError | Any) -> APIError:
        """pydantic's (or FastAPI's) validation errors, as one readable message naming the fields."""
        errors = e.errors()
        if errors and errors[0]["type"] == "json_invalid":
            return cls(f"the body is not valid JSON: {errors[0].get('ctx', {}).get('error', 'decode error')}")
        unknown = [_where(err) for err in errors if err["type"] == "extra_forbidden"]
        if unknown:
            names = ", ".join(f"`{n}`" for n in unknown)
            return cls(f"{names} {'is' if len(unknown) == 1 else 'are'} not supported by this server (a field it "
                       "does not implement is refused, not ignored)", param=unknown[0])
        parts = [f"{_where(err) or 'body'}: {err['msg']}" for err in errors]
        return cls("invalid request: " + "; ".join(parts), 400, (_where(errors[0]) if errors else None) or None)


def _where(err: dict) -> str:
    return ".".join(str(x) for x in err["loc"] if x != "body")


def failure(e: BaseException) -> APIError:
    """The answer of a request that failed after it was accepted: 503 when the engine is dead, else a 500 naming
    the failure (logged with its traceback: a fault inside the engine)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineDead):
        return APIError(str(e), 503)
    if isinstance(e, RequestError):
        return APIError(str(e), param=e.param)
    log.error("a request failed in the engine", exc_info=e)
    return APIError(f"the request failed in the engine: {type(e).__name__}: {e}", 500)


class _Strict(BaseModel):
    """No coercion ("3", 3.0 and true are not integers), finite floats only, unknown fields refused; an unknown
    field set to null counts as absent."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_absent(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k in cls.model_fields}
        return data


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields both endpoints share (OpenAI's, and vLLM's extensions top_k, min_p, ignore_eos...)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None
    truncate_prompt_tokens: int | None = None    # vLLM's: keep the prompt's last k tokens (-1: the context limit)
    prompt_logprobs: int | None = None           # vLLM's: per prompt token, its log-probability and the k likeliest
    return_tokens_as_token_ids: bool = False     # vLLM's: logprobs spell tokens `token_id:N`
    # IGNORED
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, default_max: int,
                        names: dict[str, str] | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's parameters; `names` renames SamplingParams fields to the request's in error messages
        (max_tokens given as max_completion_tokens, say)."""
        self.check_prompt_logprobs()
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                raise APIError(f"{name} is not supported by this server", param=name)
        if self.repetition_penalty not in (None, 1):
            raise APIError("repetition_penalty is not supported by this server", param="repetition_penalty")
        if self.logit_bias:
            raise APIError("logit_bias is not supported by this server", param="logit_bias")
        if not 1 <= self.n <= MAX_N:
            raise APIError(f"n={self.n} must be an integer in [1, {MAX_N}]", param="n")
        if self.best_of not in (None, self.n):
            raise APIError(f"best_of={self.best_of} other than n={self.n} is not supported by this server",
                           param="best_of")
        fields = dict(max_tokens=default_max if max_tokens is None else max_tokens,
                      temperature=1.0 if self.temperature is None else self.temperature,
                      top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
                      min_p=self.min_p or 0.0, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                      ignore_eos=self.ignore_eos, include_stop_str_in_output=self.include_stop_str_in_output,
                      logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        try:
            return SamplingParams(**fields)
        except ValueError as e:
            name = str(e).split("=")[0]
            if name not in fields:
                raise APIError(str(e)) from None
            shown = (names or {}).get(name, name)
            raise APIError(shown + str(e)[len(name):], param=shown) from None

    def check_prompt_logprobs(self) -> None:
        """vLLM's bounds on prompt_logprobs, but for -1 (the whole vocabulary), which is not implemented."""
        k = self.prompt_logprobs
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise APIError(f"prompt_logprobs={k} must be an integer in [0, {MAX_LOGPROBS}]"
                           + " (-1, the whole vocabulary, is not supported)" * (k == -1), param="prompt_logprobs")
        if k is not None and self.stream:
            raise APIError("prompt_logprobs are not available with stream=true", param="prompt_logprobs")

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed with stream=true", param="stream_options")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: str | list[Any]      # text, texts, token ids or lists of token ids: checked by OpenAIServing
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def parse(model: type[BaseModel], body: Any) -> Any:
    """A request model from a decoded JSON body, or APIError(400)."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise APIError.of_validation(e) from None


class OpenAIServing:
    """Completions, chat completions, models and tokenization of one LLM, as OpenAI (and vLLM) shape them."""

    def __init__(self, llm: LLM, model_name: str):
        self.llm, self.model_name = llm, model_name
        self.created = int(time.time())

    # ---- small endpoints -------------------------------------------------------------------------
    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "jaxinfer", "root": str(self.llm.path),
                                            "max_model_len": self.llm.config.context_length}]}

    def tokenize(self, req: TokenizeRequest) -> dict:
        self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of prompt and messages")
        if req.prompt is not None:
            ids = self._encode(req.prompt, add_bos=None if req.add_special_tokens else False)
        else:
            ids = self._chat_ids(req.messages, req.add_generation_prompt, req.chat_template_kwargs)
        return {"count": len(ids), "max_model_len": self.llm.config.context_length, "tokens": ids}

    def detokenize(self, req: DetokenizeRequest) -> dict:
        self._check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < self.llm.config.vocab_size]
        if bad:
            raise APIError(f"token ids {bad[:5]} are outside the vocabulary of {self.llm.config.vocab_size}",
                           param="tokens")
        return {"prompt": self._tokenizer().decode(req.tokens)}

    def tokenizer_info(self) -> dict:
        """vLLM's /tokenizer_info: the tokenizer's config and chat template (jaxinfer.tokenizer.Tokenizer.info)."""
        if self.llm.tokenizer is None:
            raise APIError(f"{self.llm.source} has no tokenizer.json, so no tokenizer to describe", 404)
        return self.llm.tokenizer.info()

    # ---- generation ------------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest) -> dict | AsyncIterator[str]:
        """The response body, or (stream=True) an iterator of server-sent event lines. With echo, the text (and the
        logprobs, if asked) cover the prompt, then the completion; max_tokens 0 with echo, the prompt alone."""
        self._check_model(req.model)
        req.check_stream_options()
        if req.suffix:
            raise APIError("suffix is not supported by this server", param="suffix")
        echo_only = req.max_tokens == 0
        if echo_only and not req.echo:
            raise APIError("max_tokens=0 needs echo=true (it returns the prompt alone, with its logprobs if asked)",
                           param="max_tokens")
        prompts = [self._truncate(p, req.truncate_prompt_tokens) for p in self._prompts(req.prompt)]
        for p in prompts:
            self._check_prompt(p)
        default = min(16, *(self.llm.engine.room(len(p)) for p in prompts))
        max_tokens = 1 if echo_only else req.max_tokens        # the prompt's step draws a token anyway
        asked = [k for k in (req.logprobs if req.echo else None, req.prompt_logprobs) if k is not None]
        params = req.sampling_params(max_tokens, req.logprobs, default_max=default,
                                     prompt_logprobs=max(asked) if asked else None)
        self._check_lengths(prompts, params, max_tokens, "max_tokens")
        echo = [self._tokenizer().decode(p) if req.echo else "" for p in prompts]
        streams = self._submit(prompts, params, req.n)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        as_ids = req.return_tokens_as_token_ids

        def head(choices: list[dict]) -> dict:
            return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                    "choices": choices}

        def choice(i: int, text: str, token_ids: list[int], logprobs: list[dict] | None, finish: str | None,
                   stop_reason: int | str | None = None, prompt: list[dict | None] | None = None) -> dict:
            """Choice i showing these new tokens and, where `prompt` (its prompt log-probabilities) is given, its
            echoed prompt before them."""
            if echo_only:
                text, token_ids, logprobs = "", [], []
            if prompt is not None:
                ids = prompts[i // req.n]
                prompt = prompt + [None] * (len(ids) - len(prompt))   # an aborted prompt's may be cut short
                text, token_ids, logprobs = echo[i // req.n] + text, ids + token_ids, prompt + (logprobs or [])
            lp = None if req.logprobs is None else self._completion_logprobs(token_ids, logprobs, req.logprobs, as_ids)
            return {"index": i, "text": text, "logprobs": lp, "finish_reason": finish, "stop_reason": stop_reason}

        if not req.stream:
            done = await _results(streams)
            choices = [choice(i, c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason,
                              (c.prompt_logprobs or []) if req.echo else None)
                       | self._prompt_logprobs(c, req.prompt_logprobs) for i, c in enumerate(done)]
            shown = [dataclasses.replace(c, token_ids=[]) if echo_only else c for c in done]
            return head(choices) | {"usage": _usage(prompts, shown)}

        async def events() -> AsyncIterator[str]:
            async for i, token, delta, finished in _merged(streams):
                s = streams[i]
                if token is None:
                    yield sse(head([choice(i, "", [], [], finished.finish_reason, finished.stop_reason)]))
                    continue
                prompt = (s.stream.prompt_logprobs or []) if req.echo and s.seen == 1 else None
                yield sse(head([choice(i, delta, [token], s.logprobs[s.seen - 1:s.seen], None, prompt=prompt)]))
            if req.include_usage:
                done = [s.completion for s in streams]
                shown = [dataclasses.replace(c, token_ids=[]) if echo_only else c for c in done]
                yield sse(head([]) | {"usage": _usage(prompts, shown)})
            yield "data: [DONE]\n\n"
        return events()

    async def chat(self, req: ChatCompletionRequest) -> dict | AsyncIterator[str]:
        self._check_model(req.model)
        req.check_stream_options()
        if req.tools:
            raise APIError("tools (function calling) are not supported by this server", param="tools")
        if req.tool_choice not in (None, "none"):
            raise APIError('tool_choice other than "none" is not supported by this server (no function calling)',
                           param="tool_choice")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise APIError("response_format other than text is not supported by this server",
                           param="response_format")
        if req.top_logprobs is not None:
            if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
                raise APIError(f"top_logprobs={req.top_logprobs} must be an integer in [0, {MAX_LOGPROBS}]",
                               param="top_logprobs")
            if not req.logprobs:
                raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        prompt = self._truncate(self._chat_ids(req.messages, req.add_generation_prompt, req.chat_template_kwargs),
                                req.truncate_prompt_tokens)
        self._check_prompt(prompt)
        name = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
        max_tokens = getattr(req, name)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = req.sampling_params(max_tokens, logprobs, default_max=self.llm.engine.room(len(prompt)),
                                     names={"max_tokens": name, "logprobs": "top_logprobs"},
                                     prompt_logprobs=req.prompt_logprobs)
        self._check_lengths([prompt], params, max_tokens, name)
        streams = self._submit([prompt], params, req.n)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def head(kind: str, choices: list[dict]) -> dict:
            return {"id": rid, "object": kind, "created": created, "model": self.model_name, "choices": choices}

        def lp(token_ids: list[int], logprobs: list[dict] | None) -> dict | None:
            if logprobs is None:
                return None
            return self._chat_logprobs(token_ids, logprobs, req.top_logprobs or 0, req.return_tokens_as_token_ids)

        if not req.stream:
            done = await _results(streams)
            choices = [{"index": i, "message": {"role": "assistant", "content": c.text},
                        "logprobs": lp(c.token_ids, c.logprobs), "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason} for i, c in enumerate(done)]
            # vLLM's prompt_logprobs on the response (one prompt for every choice), after the choices
            return (head("chat.completion", choices) | self._prompt_logprobs(done[0], req.prompt_logprobs)
                    | {"usage": _usage([prompt], done)})

        async def events() -> AsyncIterator[str]:
            chunk = "chat.completion.chunk"
            for i in range(len(streams)):
                yield sse(head(chunk, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}]))
            async for i, token, delta, finished in _merged(streams):
                s = streams[i]
                if token is None:
                    yield sse(head(chunk, [{"index": i, "delta": {}, "logprobs": None,
                                             "finish_reason": finished.finish_reason,
                                             "stop_reason": finished.stop_reason}]))
                    continue
                entries = s.logprobs[s.seen - 1:s.seen] if logprobs is not None else None
                yield sse(head(chunk, [{"index": i, "delta": {"content": delta},
                                         "logprobs": lp([token], entries), "finish_reason": None}]))
            if req.include_usage:
                yield sse(head(chunk, []) | {"usage": _usage([prompt], [s.completion for s in streams])})
            yield "data: [DONE]\n\n"
        return events()

    # ---- helpers ---------------------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model and model != self.model_name:
            raise APIError(f"the model `{model}` does not exist; this server serves `{self.model_name}`", 404,
                           param="model", code="model_not_found")

    def _tokenizer(self):
        if self.llm.tokenizer is None:
            raise APIError(f"{self.llm.path} has no tokenizer.json: send prompts as token ids")
        return self.llm.tokenizer

    def _encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        tok = self._tokenizer()
        try:
            return tok.encode(text, add_bos=add_bos)
        except (TokenizerError, TypeError, ValueError) as e:
            raise APIError(f"the prompt cannot be tokenized: {e}" + _SURROGATES * isinstance(e, TypeError),
                           param="prompt") from None

    def _prompts(self, prompt: str | list) -> list[list[int]]:
        """The prompts as token ids: a text, texts, token ids, or lists of token ids (each id an int in the
        vocabulary)."""
        if isinstance(prompt, str) or (prompt and not isinstance(prompt[0], str | list)):
            prompt = [prompt]
        if not prompt:
            raise APIError("prompt is empty", param="prompt")
        vocab, ids = self.llm.config.vocab_size, []
        for p in prompt:
            if isinstance(p, str):
                ids.append(self._encode(p))
                continue
            if not isinstance(p, list):
                raise APIError("prompt must be a string, a list of strings, a list of token ids or a list of lists "
                               "of token ids", param="prompt")
            bad = [t for t in p if type(t) is not int or not 0 <= t < vocab]
            if bad:
                raise APIError(f"prompt token ids {_short(bad[:5])} must be integers in [0, {vocab}) (the "
                               f"vocabulary)", param="prompt")
            ids.append(p)
        return ids

    def _truncate(self, ids: list[int], keep: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: the last `keep` tokens (-1: as many as the context holds)."""
        if keep is None:
            return ids
        limit = self.llm.config.context_length
        if keep != -1 and not 1 <= keep <= limit:
            raise APIError(f"truncate_prompt_tokens={keep} must be -1 (the context limit) or an integer in "
                           f"[1, {limit}]", param="truncate_prompt_tokens")
        return ids[-(limit if keep == -1 else keep):]

    def _chat_ids(self, messages: list[dict], add_generation_prompt: bool, kwargs: dict | None) -> list[int]:
        tok, messages = self._tokenizer(), [_flatten(m) for m in messages]
        try:
            return tok.chat_ids(messages, add_generation_prompt=add_generation_prompt, **(kwargs or {}))
        except (TokenizerError, TypeError) as e:
            raise APIError(str(e) + _SURROGATES * isinstance(e, TypeError), param="messages") from None
        except Exception as e:  # noqa: BLE001 - a template that fails on these messages is the request's fault
            raise APIError(f"the chat template failed on these messages: {e}", param="messages") from None

    def _check_prompt(self, ids: list[int]) -> None:
        try:
            self.llm.engine.check_prompt(ids)
        except RequestError as e:
            raise APIError(str(e), param=e.param or "prompt") from None

    def _check_lengths(self, prompts: list[list[int]], params: SamplingParams, asked: int | None, name: str) -> None:
        """Each prompt with the max_tokens asked for (`name` in the request) fits the context, and with those
        the context allows, one replica's KV page pool."""
        limit = self.llm.config.context_length
        for p in prompts:
            if asked is not None and len(p) + asked > limit:
                raise APIError(f"this model's maximum context length is {limit} tokens; the request asks for "
                               f"{len(p) + asked} ({len(p)} in the prompt, {asked} in the completion)", param=name)
            try:
                self.llm.engine.check_request(p, params)
            except RequestError as e:
                raise APIError(str(e), param=name if e.param == "max_tokens" else e.param) from None

    def _submit(self, prompts: list[list[int]], params: SamplingParams, n: int) -> list[_Choice]:
        """n choices per prompt (prompt-major). With a seed, choice i is drawn with seed + i, as in vLLM."""
        each = [params if params.seed is None else dataclasses.replace(params, seed=(params.seed + i) % SEED_LIMIT)
                for i in range(n)]
        try:
            streams = self.llm.loop.submit_all([p for p in prompts for _ in range(n)], each * len(prompts),
                                               asynchronous=True)
        except RequestError as e:
            raise APIError(str(e), param=e.param) from None
        except RuntimeError as e:   # EngineDead, or a loop closed by the server's shutdown
            raise APIError(str(e), 503) from None
        return [_Choice(s) for s in streams]

    def _token_text(self, token: int, as_id: bool = False) -> str:
        if as_id:
            return f"token_id:{token}"
        return self.llm.tokenizer.decode([token], skip_special_tokens=False) if self.llm.tokenizer else str(token)

    def _top(self, entry: dict[int, float], k: int) -> list[tuple[int, float]]:
        return sorted(entry.items(), key=lambda kv: (-kv[1], kv[0]))[:k]

    def _top_texts(self, top: list[tuple[int, float]], as_ids: bool) -> dict[str, float]:
        """One position's alternatives keyed by text, most likely first. A text a likelier token already keys, or
        one that reads `token_id:N`, is keyed by the token's own `token_id:N` instead: no alternative is lost,
        and such a key always names one token."""
        out: dict[str, float] = {}
        for token, v in top:
            key = self._token_text(token, as_ids)
            if key in out or (not as_ids and _TOKEN_ID.fullmatch(key)):
                key = f"token_id:{token}"
            out[key] = _finite(v)
        return out

    def _completion_logprobs(self, token_ids: list[int], entries: list[dict | None], k: int,
                             as_ids: bool = False) -> dict:
        """OpenAI's legacy logprobs of these tokens; a None entry (the first prompt token's) shows null."""
        texts = [self._token_text(t) for t in token_ids]
        offsets = [sum(map(len, texts[:i])) for i in range(len(texts))]
        return {"tokens": [self._token_text(t, True) for t in token_ids] if as_ids else texts,
                "token_logprobs": [None if e is None else _finite(e[t])
                                   for t, e in zip(token_ids, entries, strict=True)],
                "top_logprobs": [None if e is None else self._top_texts(self._top(e, k), as_ids) for e in entries],
                "text_offset": offsets}

    def _prompt_logprobs(self, c: Completion, k: int | None) -> dict:
        """vLLM's `prompt_logprobs` field where asked for (k), else nothing: None for the first prompt token, then
        per token {"id": {"logprob", "rank", "decoded_token"}}, the token itself first, then the k most likely
        (rank 1..k; the token among them takes its place there, as in vLLM)."""
        if k is None:
            return {}

        def item(token: int, value: float, rank: int) -> dict:
            return {"logprob": _finite(value), "rank": rank, "decoded_token": self._token_text(token)}

        out: list[dict | None] = [None]
        for t, entry, rank in zip(c.prompt_token_ids[1:], c.prompt_logprobs[1:], c.prompt_ranks[1:], strict=False):
            position = {str(t): item(t, entry[t], rank)}
            position.update((str(i), item(i, v, r)) for r, (i, v) in enumerate(self._top(entry, k), 1))
            out.append(position)
        return {"prompt_logprobs": out}

    def _chat_logprobs(self, token_ids: list[int], entries: list[dict], k: int, as_ids: bool = False) -> dict:
        def item(t: int, v: float) -> dict:
            text = self._token_text(t, as_ids)
            return {"token": text, "logprob": _finite(v), "bytes": list(text.encode())}

        return {"content": [item(t, e[t]) | {"top_logprobs": [item(i, v) for i, v in self._top(e, k)]}
                            for t, e in zip(token_ids, entries, strict=True)]}


class _Choice:
    """A stream and how many of its tokens the response has carried so far."""

    def __init__(self, stream: RequestStream):
        self.stream, self.seen = stream, 0

    @property
    def logprobs(self) -> list[dict]:
        return self.stream.logprobs

    @property
    def completion(self) -> Completion | None:
        return self.stream.completion


async def _results(choices: list[_Choice]) -> list[Completion]:
    """Every choice's Completion; cancelled (a client gone), every unfinished one is aborted. A choice that failed
    raises its failure as an APIError (500, or 503 for a dead engine); the others are aborted."""
    tasks = [asyncio.ensure_future(c.stream.aresult()) for c in choices]
    try:
        return list(await asyncio.gather(*tasks))
    except Exception as e:  # noqa: BLE001 - a failure inside the engine, answered with an OpenAI error
        raise failure(e) from None
    finally:
        for t in tasks:
            t.cancel()


async def _merged(choices: list[_Choice]) -> AsyncIterator[tuple[int, int | None, str, Completion | None]]:
    """(choice, token, delta, None) as each token of any choice comes, and (choice, None, "", Completion)
    when one ends. Leaving early aborts every unfinished choice."""
    events: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, c: _Choice) -> None:
        try:
            async for token, delta in c.stream:
                await events.put((i, token, delta))
            await events.put((i, None, ""))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
            await events.put((i, e, ""))

    tasks = [asyncio.ensure_future(pump(i, c)) for i, c in enumerate(choices)]
    try:
        for _ in range(len(choices)):
            while True:
                i, token, delta = await events.get()
                if isinstance(token, BaseException):
                    raise token
                if token is None:
                    yield i, None, "", choices[i].completion
                    break
                choices[i].seen += 1
                yield i, token, delta, None
    finally:
        for t in tasks:
            t.cancel()


def _usage(prompts: list[list[int]], done: list[Completion]) -> dict:
    prompt_tokens, completion_tokens = sum(map(len, prompts)), sum(len(c.token_ids) for c in done)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(obj: dict) -> str:
    """One server-sent event carrying `obj` as compact JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _finite(v: float) -> float:
    """JSON has no -inf: a filtered-out token is reported as -9999.0, as vLLM does."""
    return max(float(v), -9999.0)


def _short(values: list) -> str:
    """Values as a client wrote them, each cut to 40 characters (a message must not echo a huge body)."""
    return "[" + ", ".join(r if len(r := repr(v)) <= 40 else r[:37] + "..." for v in values) + "]"


def _flatten(message: dict) -> dict:
    """A chat message whose content is a list of text parts, as one string (other parts are refused)."""
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise APIError("content parts other than text are not supported by this server", param="messages")
            if not isinstance(part.get("text"), str):
                raise APIError("a text content part needs a string `text`", param="messages")
            texts.append(part["text"])
        message = {**message, "content": "".join(texts)}
    if "role" not in message:
        raise APIError("every message needs a role", param="messages")
    return message
