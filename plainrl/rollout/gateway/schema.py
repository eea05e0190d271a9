"""The requests the gateway accepts, validated strictly (a wrong type is a 400 naming the field).

The OpenAI request fields the gateway reads, with the message and tool shapes of the
OpenAI API (tool definitions and assistant tool calls are the ``openai`` package's own models),
plus vLLM's extensions (``top_k``, ``stop_token_ids``, ``return_token_ids``, ...). The
``openai`` package's request types are ``TypedDict``s with lazily checked ``Iterable`` fields,
which accept a string for ``messages``; these models check everything up front. Fields the
gateway does not use are ignored, as vLLM does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from openai.types.chat import ChatCompletionFunctionTool, ChatCompletionMessageFunctionToolCall
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

__all__ = ["ChatRequest", "CompletionRequest", "GenerateRequest", "MEDIA_TYPES", "MediaPart", "Message", "OtherTool",
           "SamplingFields", "StrictModel", "TAG_MARK", "json_kind", "parts", "tagged", "tools_of"]


class StrictModel(BaseModel):
    """A request model of any dialect: types checked strictly, unknown fields ignored (as vLLM does)."""

    model_config = ConfigDict(strict=True, extra="ignore")


# Every union of a request is tagged: the member a value goes to is chosen by its JSON kind (or a
# message's role), so a bad value is reported by that member alone, and the tag, which pydantic puts
# into an error's location, starts with TAG_MARK so that errors.py drops it from the field's path.
TAG_MARK = "="


def json_kind(value: Any) -> str | None:
    """The tag of a value's JSON kind: ``=string``, ``=array`` or ``=object`` (None: another kind)."""
    for kind, types in (("string", str), ("array", list), ("object", dict)):
        if isinstance(value, types):
            return TAG_MARK + kind
    return None


def _prompt_kind(value: Any) -> str | None:
    """A completions prompt's tag: text, token ids, texts or lists of token ids (by the first element)."""
    if isinstance(value, str):
        return TAG_MARK + "text"
    if not isinstance(value, list):
        return None
    first = value[0] if value else 0
    return TAG_MARK + ("texts" if isinstance(first, str) else "id-lists" if isinstance(first, list) else "ids")


def _role(value: Any) -> str | None:
    role = value.get("role") if isinstance(value, dict) else getattr(value, "role", None)
    return TAG_MARK + role if isinstance(role, str) else None


def tagged(members: dict[str, Any], by: Any, expected: str) -> Any:
    """A union of ``members`` (tag -> type) whose member ``by(value)`` picks; anything else is
    refused with "must be {expected}"."""
    return Annotated[Union[tuple(Annotated[t, Tag(TAG_MARK + tag)] for tag, t in members.items())],
                     Discriminator(by, custom_error_type="invalid_union_member",
                                   custom_error_message=f"must be {expected}")]


class TextPart(StrictModel):
    """A text content part (the only kind a text model can read)."""

    type: Literal["text"]
    text: str


# the part types of every dialect that carry an image, audio or a document (not text)
MEDIA_TYPES = frozenset({"image_url", "input_audio", "file", "input_image", "input_file", "image", "document"})


class MediaPart(BaseModel):
    """An image, audio or document part of any dialect: refused, naming the part (the gateway
    serves text models; a vision path is later work)."""

    model_config = ConfigDict(extra="allow")
    type: str

    @model_validator(mode="after")
    def _refuse(self) -> MediaPart:
        raise ValueError(f"a {self.type!r} part: the model is text-only, so images, audio and documents cannot be "
                         "read; send the content as text parts")


def parts(text: Any, expected: str) -> Any:
    """A content part union: the dialect's ``text`` part type, or a :class:`MediaPart` (refused
    with a message naming it) for the types in :data:`MEDIA_TYPES`; anything else must be ``expected``."""
    def kind(v: Any) -> str | None:
        t = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
        return TAG_MARK + ("media" if t in MEDIA_TYPES else "text")

    return tagged({"text": text, "media": MediaPart}, kind, expected)


Content = tagged({"string": str, "array": list[parts(TextPart, 'a text part ({"type": "text", "text": ...})')]},
                 json_kind, 'a string or a list of text parts ({"type": "text", "text": ...})')


class SystemMessage(StrictModel):
    role: Literal["system"]
    content: Content
    name: str | None = None


class DeveloperMessage(StrictModel):
    """OpenAI's newer name for a system message; rendered as ``system``."""

    role: Literal["developer"]
    content: Content
    name: str | None = None


class UserMessage(StrictModel):
    role: Literal["user"]
    content: Content
    name: str | None = None


class AssistantMessage(StrictModel):
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[ChatCompletionMessageFunctionToolCall] | None = None
    reasoning_content: str | None = None
    name: str | None = None


class ToolMessage(StrictModel):
    role: Literal["tool"]
    content: Content
    tool_call_id: str | None = None
    is_error: bool | None = None  # Anthropic's tool_result flag, kept for templates that render it


Message = tagged({"system": SystemMessage, "developer": DeveloperMessage, "user": UserMessage,
                   "assistant": AssistantMessage, "tool": ToolMessage}, _role,
                  "a message whose role is system, developer, user, assistant or tool")


class OtherTool(BaseModel):
    """A tool of a type the dialect does not render (a vendor-hosted tool, or one this gateway does
    not know): kept whole, dropped from the prompt and counted."""

    model_config = ConfigDict(extra="allow")
    type: str | None = None


def tools_of(members: dict[str, Any], kind: Any = None) -> Any:
    """A tool union: ``members`` (tag -> model) chosen by ``kind(value)`` (default: the value's
    ``type``), any other tool an :class:`OtherTool`."""
    def by(v: Any) -> str:
        tag = kind(v) if kind is not None else (v.get("type") if isinstance(v, dict) else getattr(v, "type", None))
        return TAG_MARK + (tag if tag in members else "other")

    return tagged({**members, "other": OtherTool}, by, "a tool")


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(StrictModel):
    include_usage: bool | None = None


class SamplingFields(StrictModel):
    """What every generating route shares: OpenAI's sampling fields and vLLM's extensions."""

    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stop: tagged({"string": str, "array": list[str]}, json_kind, "a string or a list of strings") | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int | None = Field(None, ge=1)
    return_token_ids: bool | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's extension: plainrl.rollout.gateway.structured


class ChatRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    model: str
    messages: list[Message] = Field(min_length=1)
    tools: list[tools_of({"function": ChatCompletionFunctionTool})] | None = None
    tool_choice: tagged({"string": Literal["none", "auto", "required"], "object": NamedToolChoice}, json_kind,
                         '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}') | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool | None = None
    response_format: dict[str, Any] | None = None  # plainrl.rollout.gateway.structured


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: one prompt, text or token ids."""

    model: str
    prompt: tagged({"text": str, "ids": list[int], "texts": list[str], "id-lists": list[list[int]]}, _prompt_kind,
                    "a string, a list of token ids, a list of strings or a list of lists of token ids")
    logprobs: int | None = Field(None, ge=0, le=5)
    stream: bool | None = None
    echo: bool | None = None
    response_format: dict[str, Any] | None = None  # plainrl.rollout.gateway.structured


class GenerateSampling(SamplingFields):
    """vLLM's ``SamplingParams`` as ``/inference/v1/generate`` takes them: the fields every
    generating route shares (read here), and ``n``."""

    n: int | None = Field(None, ge=1)
    logprobs: int | None = None


class GenerateRequest(StrictModel):
    """``POST /inference/v1/generate``: vLLM's token-in, token-out route."""

    token_ids: list[int] = Field(min_length=1)
    sampling_params: GenerateSampling = Field(default_factory=GenerateSampling)
    model: str | None = None
    request_id: str | None = None
    stream: bool | None = None
