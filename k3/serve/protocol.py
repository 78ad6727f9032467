"""The OpenAI request bodies this server accepts (pydantic), and its OpenAI-style errors.

Types are strict (``"max_tokens": "5"`` is an error, not 5); unknown fields are ignored, as OpenAI's own API
does with fields it does not know; fields whose non-default values this server cannot honour (``n`` > 1,
``echo``, ``best_of``, penalties, ``response_format``...) are rejected with a message naming them. Chat takes
OpenAI's ``tools`` / ``tool_choice``, assistant ``tool_calls`` and ``role: "tool"`` messages, and ``image_url`` content
parts (the image as a ``data:`` URL; k3.vision.encode_chat decodes and checks it). ``top_k`` (0 or -1 = off) and
``ignore_eos`` (keep writing past the end-of-sequence token, for benchmarks) are extensions. ``reasoning_effort``
takes OpenAI's values and K3's ``max`` (``EFFORT_OF`` maps them to K3's efforts). Text must be valid Unicode: a lone
UTF-16 surrogate (``"\ud800"``, which JSON can spell but no encoding can carry) is refused with the field named,
wherever it is (content, prompt, stop, tool names, descriptions and parameter schemas, tool-call ids, names and
arguments, reasoning_content); ``seed`` must fit the sampler's 64-bit generator. Every error is HTTP 400 with the body
``{"error": {"message", "type": "invalid_request_error", "param", "code"}}``.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag
from pydantic_core import PydanticCustomError

__all__ = ["APIError", "CompletionRequest", "ChatRequest", "ChatMessage", "error_body", "validation_message"]

_NO_PENALTIES = {"presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {})}


class APIError(Exception):
    """A request the server refuses; becomes an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None, code: str | None = "invalid_value",
                 status: int = 400, type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.param, self.code, self.type)


def error_body(message: str, param: str | None = None, code: str | None = None,
               type: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


_EXPECTED = {"prompt": "a string or a list of token ids", "stop": "a string or a list of strings",
             "content": "a string or a list of text and image_url parts"}


def _short(value: Any) -> str:
    r = repr(value)
    return r if len(r) <= 80 else r[:77] + "..."


def _valid_unicode(text: Any) -> Any:
    if not isinstance(text, str):  # the type check comes after: this runs first, before a pattern could say less
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PydanticCustomError("lone_surrogate", "contains a lone UTF-16 surrogate ({char}) at character "
                                  "{pos}, which is not text; send valid Unicode (surrogates only in pairs)",
                                  {"char": f"\\u{ord(text[e.start]):04x}", "pos": e.start}) from None
    return text


Text = Annotated[str, BeforeValidator(_valid_unicode)]


def _valid_json_text(value: Any, where: str = "") -> Any:
    """Every key and string in a JSON value (a tool's parameters schema) is valid Unicode; the error names where."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        at = f"{where}.{key}" if where else str(key)
        for text in ((key, item) if isinstance(key, str) else (item,)):
            if isinstance(text, str):
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise PydanticCustomError(
                        "lone_surrogate", "contains a lone UTF-16 surrogate ({char}) in {at}, which is not text; "
                        "send valid Unicode (surrogates only in pairs)",
                        {"char": f"\\u{ord(text[e.start]):04x}",
                         "at": at.encode("utf-8", "backslashreplace").decode("utf-8")}) from None
        if isinstance(item, (dict, list)):
            _valid_json_text(item, at)
    return value


# keys untyped: pydantic's own check of a key with a lone surrogate puts the key in the error's location, which then
# cannot be reported at all (errors() raises); this validator names the place, its surrogates escaped
JSONObject = Annotated[dict, AfterValidator(_valid_json_text)]

# reasoning_effort: OpenAI's values and K3's own -> the effort the chat format renders (None: no thinking). K3 is
# post-trained at low, high and max (k3.post: EFFORTS); OpenAI's minimal and medium map to the nearest of those.
EFFORT_OF = {"none": None, "minimal": "low", "low": "low", "medium": "high", "high": "high", "xhigh": "max",
             "max": "max"}
Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


def validation_message(errors: list[dict]) -> tuple[str, str | None, str]:
    """(message, param, code) for pydantic/FastAPI validation errors, naming the first offending field (a lone
    surrogate first: the other members of a union would only say the type is wrong)."""
    e = next((x for x in errors if x.get("type") == "lone_surrogate"), errors[0])
    raw = [str(x) for x in e.get("loc", ()) if x != "body"]
    # union members add their type to the location (prompt.str, stop.list[str]): keep the field path only
    loc = [x for x in raw if not any(c in x for c in "[]()") and x not in ("str", "int", "float", "bool")]
    param = ".".join(loc) or None
    if e.get("type") == "json_invalid":
        detail = (e.get("ctx") or {}).get("error") or e.get("msg", "")
        return f"the request body is not valid JSON ({detail}); send a JSON object", None, "invalid_json"
    if e.get("type") == "missing":
        if not loc:
            return "the request body is empty; send a JSON object", None, "missing_required_parameter"
        return f"missing required field {param!r}", param, "missing_required_parameter"
    if not loc:
        if isinstance(e.get("input"), bytes):
            return ("the request body was not read as JSON: send a JSON object with the header "
                    "'Content-Type: application/json'"), None, "invalid_json"
        return f"the request body must be a JSON object; got {_short(e.get('input'))}", None, "invalid_type"
    field = loc[-1] if not loc[-1].isdigit() else loc[-2]
    if e.get("type") == "lone_surrogate":
        return f"invalid value for {param}: {e.get('msg')}", param, "invalid_value"
    if raw != loc and field in _EXPECTED:
        return f"invalid value for {param}: expected {_EXPECTED[field]}", param, "invalid_type"
    code = "invalid_type" if e.get("type", "").endswith(("_type", "_parsing")) else "invalid_value"
    return f"invalid value for {param}: {e.get('msg', 'invalid')}; got {_short(e.get('input'))}", param, code


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """Fields common to both endpoints (null means "default", as in OpenAI's API)."""

    model: Text
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    ignore_eos: bool = False  # a k3 (and vLLM) extension: write max_tokens tokens whatever the model says (benchmarks)
    seed: int | None = Field(None, ge=-2**63, le=2**64 - 1)  # what torch.Generator.manual_seed takes
    stop: Text | list[Text] | None = None
    n: int | None = Field(None, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None

    ONLY: ClassVar[dict[str, tuple]] = _NO_PENALTIES  # field -> the only values this server can honour

    def check_supported(self) -> None:
        for name, accepted in self.ONLY.items():
            value = getattr(self, name)
            if value not in accepted:
                raise APIError(f"{name}={value!r} is not supported by this server; leave it out (or send one of "
                               f"{[a for a in accepted if a is not None]})", name, "unsupported_parameter")

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(s == "" for s in stops):
            raise APIError("stop strings must be non-empty", "stop")
        return stops


class CompletionRequest(_Sampling):
    prompt: Text | list[int] | list[Text] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None
    ONLY = {**_NO_PENALTIES, "echo": (None, False), "best_of": (None, 1), "suffix": (None, "")}


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class ImageURL(_Body):
    url: Text  # a data: URL (k3 fetches nothing: http(s) URLs are refused when the prompt is built)
    detail: Literal["auto", "low", "high"] | None = None  # accepted; k3 always sees the image at native resolution


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageURL


def _part_kind(part: Any) -> str | None:
    kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
    return {"text": "part(text)", "image_url": "part(image_url)"}.get(kind)  # tags in () leave error paths


ContentPart = Annotated[Annotated[TextPart, Tag("part(text)")] | Annotated[ImagePart, Tag("part(image_url)")],
                        Discriminator(_part_kind, custom_error_type="invalid_part",
                                      custom_error_message="a content part's type must be 'text' or 'image_url'")]


class FunctionCall(_Body):
    name: Text
    arguments: Text  # JSON, as OpenAI sends it


class ToolCall(_Body):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionSpec(_Body):
    name: Text = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: Text | None = None
    parameters: JSONObject | None = None
    strict: bool | None = None


class ToolSpec(_Body):
    type: Literal["function"]
    function: FunctionSpec


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: Annotated[dict[Any, Text], AfterValidator(_valid_json_text)]


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: Text | None = None  # tool
    reasoning_content: Text | None = None  # assistant (thinking models)

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content if isinstance(p, TextPart))
        return self.content or ""

    def as_dict(self) -> dict:
        """The message as the chat formats take it: content as plain text, or as its parts when it holds images
        (k3.vision.encode_chat renders those)."""
        images = isinstance(self.content, list) and any(isinstance(p, ImagePart) for p in self.content)
        d = {"role": self.role,
             "content": [p.model_dump(exclude_none=True) for p in self.content] if images else self.text()}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        if self.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return d


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=5)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Effort | None = None
    response_format: dict[str, Any] | None = None
    ONLY = {**_NO_PENALTIES, "response_format": (None, {"type": "text"})}

    def tool_specs(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def effort(self) -> str | None:
        """The reasoning effort the chat format renders (``EFFORT_OF``): None for none or when left out."""
        return EFFORT_OF[self.reasoning_effort] if self.reasoning_effort is not None else None

    def tool_choice_value(self) -> Any:
        return self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice

