"""The HTTP API's requests and errors, for every route: each request body is a pydantic model parsed by parse_request
(one error line naming every field that is wrong), and every error answer has OpenAI's shape."""

import json
import sys
from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.requests import ClientDisconnect

MAX_BODY_BYTES = 1 << 20
MAX_STOPS = 4  # as at OpenAI
MAX_LOGPROBS = 20  # as vLLM's default; OpenAI's is 5
PROMPT_FORMS = "a string, a list of strings, a list of token ids, or a list of token-id lists, none of them empty"
AUTO_HALTING = "kl:0.0005"  # what n_sup "auto" runs: Huginn's exit threshold on KL(p_s || p_{s-1})
# OpenAI's fields this server does not implement, and the values at which they change nothing
NEUTRAL = {"best_of": 1, "suffix": "", "logit_bias": {}, "frequency_penalty": 0.0, "presence_penalty": 0.0}


class Body(BaseModel):
    """A request body: a typo'd field or "5" for 5 is an error, as at OpenAI; null means the default."""
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def null_means_default(cls, data):  # as at OpenAI, where every optional field is nullable
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(Body):
    include_usage: bool = False


class Sampling(Body):
    """What completions and chat completions share: the model's name, sampling, streaming, the steps."""
    model: str | None = None
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, ge=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1)
    stop: str | list[str] = []
    seed: int | None = Field(None, ge=0, lt=2 ** 63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n_sup: int | str | None = None  # steps, or "auto" / "RULE:THRESHOLD" for per-token halting: see depth
    user: str | None = None  # OpenAI's end-user id for abuse monitoring: nothing to do with it here
    logit_bias: dict[str, float] = {}
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0


class CompletionRequest(Sampling):
    prompt: object  # four forms, told apart (and refused in one sentence) by split_prompt
    max_tokens: int | None = Field(None, ge=0)  # None: 16, or the server's limit if lower
    echo: bool = False
    best_of: int = 1
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str = ""


class TextPart(Body):
    type: Literal["text"]
    text: str


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]  # a string, or OpenAI's list of text parts
    name: str | None = None  # OpenAI's participant name: nothing to do with it here

    def plain(self):
        """{role, content} as nanochat/data/chat.py renders it: text parts joined, a developer message (OpenAI's newer
        name) a system one."""
        content = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatCompletionRequest(Sampling):
    messages: list[ChatMessage]  # rendered as chat_sft trained (nanochat/data/chat.py), answered by the assistant
    max_tokens: int | None = Field(None, ge=1)  # None: the server's limit (the reply ends at <|assistant_end|>)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    drafts: bool = False  # extension: each choice's reply at every supervision step too (Server.drafts)


CHAT_NEUTRAL = {"logprobs": False, "logit_bias": {}, "frequency_penalty": 0.0, "presence_penalty": 0.0}


# /v1/refinement, one body per mode (nanochat/serve/refinement.py); ranges are checked against the model there
class RefineGenerate(Body):
    mode: Literal["generate"] = "generate"
    prompt: str | None = None  # a text, after <|bos|>; or
    messages: list[ChatMessage] | None = None  # a conversation, answered as /v1/chat/completions answers it
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    n_sup: int | None = None
    halt: str | None = None  # "RULE:THRESHOLD": the rule each token's halting step is marked by
    drafts: bool = False
    stream: bool = False


class RefineScore(Body):
    mode: Literal["score"]
    text: str
    n_sup: int | None = None


class RefineHops(Body):
    mode: Literal["hops"]
    text: str | None = None  # a hops document, or seed: draw one
    seed: int | None = None
    n_queries: int | None = None
    n_sup: int | None = None


REFINEMENT_MODES = {"generate": RefineGenerate, "score": RefineScore, "hops": RefineHops}


class APIError(Exception):
    def __init__(self, status, message, param=None, code=None, headers=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_response(status, message, param=None, code=None, headers=None):
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status,
                        headers=headers)


async def read_body(request):
    """The JSON object of a request, or a 4xx saying what is wrong with it."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":  # a form or text/plain POST is one a page of any other site may send
        got = f"its Content-Type is {json.dumps(media_type)}" if media_type else "it has no Content-Type"
        raise APIError(415, f"the body must be JSON sent with the header Content-Type: application/json, and {got} "
                            f"(curl: -H 'Content-Type: application/json')")
    body = b""
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise APIError(413, f"request body exceeds {MAX_BODY_BYTES} bytes")
    except ClientDisconnect:  # closed by the client, or by the read timeout (GuardedHTTP): no one to answer
        raise APIError(400, "the client closed the connection before the request body arrived") from None
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(400, "request body nests too deeply to parse; a completions request nests 3 levels") from None
    except ValueError:  # Python refuses to read an integer past its int-to-string limit (CVE-2020-10735)
        raise APIError(400, f"request body holds an integer of more than {sys.get_int_max_str_digits()} digits; "
                            f"no field takes one that long") from None


def field_path(loc):
    """A validation error's location as one line: a key holding a line break or another control character is quoted."""
    return ".".join(p if isinstance(p, str) and p.isprintable() else json.dumps(p) for p in loc)


def parse_request(obj, schema=CompletionRequest):
    """The body obj as a schema (a Body), or an APIError naming every field that is wrong."""
    try:
        return schema.model_validate(obj)
    except ValidationError as e:
        own = schema.__annotations__  # the route's own fields (a prompt, messages) before the shared ones
        fields = ", ".join(sorted(schema.model_fields, key=lambda f: (f != "model", f not in own)))
        problems = "; ".join(f"{field_path(err['loc']) or 'body'}: " + (f"unknown field; the fields are {fields}"
                                                                        if err["type"] == "extra_forbidden"
                                                                        else err["msg"]) for err in e.errors())
        param = field_path(e.errors()[0]["loc"][:1]) or None
        raise APIError(400, problems, param) from None


def parse_refinement(obj):
    """A /v1/refinement body as the schema of its mode (generate by default), or an APIError."""
    if not isinstance(obj, dict):
        raise APIError(400, "the body must be a JSON object")
    mode = obj.get("mode") or "generate"
    if not isinstance(mode, str) or mode not in REFINEMENT_MODES:  # a list or an object is no key to look up
        raise APIError(400, f"mode: one of {', '.join(REFINEMENT_MODES)}, got {json.dumps(mode)}", "mode")
    return parse_request(obj, REFINEMENT_MODES[mode])


def is_token_ids(value):
    return isinstance(value, list) and len(value) > 0 and all(type(t) is int for t in value)  # bool is not an id


def split_prompt(prompt):
    """OpenAI's prompt forms -> a list of prompts, each a string or a list of token ids; an APIError if malformed."""
    if isinstance(prompt, str) or is_token_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt) or
                                                all(is_token_ids(p) for p in prompt)):
        return prompt
    raise APIError(400, f"prompt must be {PROMPT_FORMS}", "prompt")


def token_offsets(token_bytes):
    """Where each token starts in the text the tokens decode to, in characters (counting a UTF-8 character at its
    first byte: a token that starts inside a character starts where that character does)."""
    offsets, chars = [], 0
    for piece in token_bytes:
        starts_inside = len(piece) > 0 and 0x80 <= piece[0] < 0xC0
        offsets.append(max(0, chars - starts_inside))
        chars += sum(not 0x80 <= b < 0xC0 for b in piece)
    return offsets
