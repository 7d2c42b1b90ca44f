"""Request bodies of the HTTP API: OpenAI's field names, types and limits.

Models are strict (a string is not a number, 1.0 is not an int). Those of the
OpenAI routes ignore unknown fields, as vLLM does, so that newer OpenAI clients
keep working; those of the native `/generate` (the engine's own names) refuse
them.
Responses are built as plain dicts in the route modules.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

# limits (OpenAI's where it has one)
MAX_N = 16
MAX_COMPLETION_LOGPROBS = 5  # legacy completions: `logprobs` <= 5
MAX_TOP_LOGPROBS = 20  # chat: `top_logprobs` <= 20
MAX_STOP = 4
MAX_STOP_LEN = 1024
MAX_PROMPTS = 64  # prompts in one completions request
MAX_LOGIT_BIAS_ENTRIES = 1024
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_INT = 2**31 - 1  # bound for counts: absurd values fail validation, not arithmetic
MAX_STAGES = 64  # a fork/join request's later stages
MAX_STAGE_BRANCHES = 64  # branches of one parallel stage


def _utf8(s: str) -> str:
    # JSON may carry lone surrogates ("\ud800"): valid JSON, not valid text
    if s.isascii():  # O(1) in CPython; encoding a 16 MB prompt to check it took ~10 ms of the event loop
        return s
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid UTF-8 text (found an unpaired surrogate)") from None
    return s


def _utf8_json(v):
    """A JSON value whose every string, keys included, is valid text: a tool's
    parameters, a schema or template variables reach the tokenizer and the
    grammar compiler as text."""
    todo = [v]
    while todo:
        x = todo.pop()
        if isinstance(x, str):
            _utf8(x)
        elif isinstance(x, dict):
            todo.extend(x.keys())
            todo.extend(x.values())
        elif isinstance(x, list):
            todo.extend(x)
    return v


Text = Annotated[str, AfterValidator(_utf8)]
JsonObject = Annotated[dict, AfterValidator(_utf8_json)]  # any JSON object, its strings valid text
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LEN), AfterValidator(_utf8)]
TokenId = Annotated[int, Field(ge=0, le=MAX_INT)]
Seconds = Annotated[float, Field(gt=0.0, le=1e6)]


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True, allow_inf_nan=False)


class StreamOptions(_Model):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far in every chunk


class JsonSchemaSpec(_Model):
    name: Text = "response"
    description: Optional[Text] = None
    schema_: Optional[JsonObject] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaSpec] = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format of type 'json_schema' needs json_schema.schema")
        return self


# Fields of OpenAI's or vLLM's API that stepserve does not implement and that
# would change the result: a request that sets one gets a 400 naming it (a
# client must not believe it was honoured). A value in HARMLESS_VALUES is what
# the field's absence means, and passes. Other unknown fields change nothing and
# are ignored, as vLLM does.
_UNSUPPORTED_BOTH = {
    "bad_words": "bad_words",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids",
    "typical_p": "typical_p sampling",
}
UNSUPPORTED_FIELDS = {
    "completions": {
        **_UNSUPPORTED_BOTH,
        # the chat route's (or SGLang's native) names for what this route names otherwise
        "max_completion_tokens": "max_completion_tokens on this route (use max_tokens)",
        "max_new_tokens": "max_new_tokens on this route (use max_tokens)",
        "top_logprobs": "top_logprobs on this route (use logprobs, a count)",
        "tools": "tools on this route (use /v1/chat/completions)",
        "tool_choice": "tool_choice on this route (use /v1/chat/completions)",
    },
    "chat": {
        **_UNSUPPORTED_BOTH,
        "max_new_tokens": "max_new_tokens on this route (use max_completion_tokens)",
        "best_of": "best_of on chat",
        "suffix": "suffix on chat",
        "use_beam_search": "beam search on chat (it runs on /v1/completions)",
        "length_penalty": "beam search on chat (it runs on /v1/completions)",
        "functions": "the legacy functions field (use tools)",
        "function_call": "the legacy function_call field (use tool_choice)",
        "audio": "audio output",
        "modalities": "output modalities other than text",
        "prediction": "predicted outputs",
        "web_search_options": "web search",
        "chat_template": "a chat template in the request",
        "ebnf": "EBNF grammars (use structured_outputs.grammar, Lark)",
        "documents": "documents for the chat template",
        "mm_processor_kwargs": "multimodal inputs",
    },
}
HARMLESS_VALUES = {
    "functions": ([],),
    "function_call": ("none",), "use_beam_search": (False,),
    "return_tokens_as_token_ids": (False,),
    "modalities": (["text"],), "bad_words": ([],), "length_penalty": (1.0,),
    "typical_p": (1.0,), "best_of": (1,), "tools": ([],), "tool_choice": ("none",),
}


class StructuredOutputs(_Model):
    """vLLM's `structured_outputs`: exactly one constraint."""

    json_: Optional[Union[JsonObject, Text]] = Field(None, alias="json")  # a JSON schema (or its text)
    regex: Optional[Text] = None
    choice: Optional[Annotated[list[Text], Field(min_length=1, max_length=1024)]] = None
    grammar: Optional[Text] = None  # Lark (EBNF-like)
    json_object: Optional[bool] = None

    def constraint(self) -> tuple[str, object]:
        """(engine.grammar kind, spec)."""
        # given is not None: an empty schema {} (any JSON) and an empty regex are constraints too
        given = [(k, v) for k, v in (("json", self.json_), ("regex", self.regex), ("choice", self.choice),
                                     ("lark", self.grammar), ("json_object", self.json_object or None))
                 if v is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar and json_object")
        kind, spec = given[0]
        if kind == "json_object":
            return "json", {"type": "object"}
        if kind == "json" and isinstance(spec, str):
            import json

            try:
                spec = json.loads(spec)
            except ValueError as e:
                raise ValueError(f"json is not a JSON schema: {e}") from None
            except RecursionError:  # valid JSON nested past the parser's depth: no usable schema either
                raise ValueError("json is not a JSON schema: it is nested too deeply") from None
        return kind, spec


class _SamplingFields(_Model):
    """Fields common to completions and chat (plus vLLM's sampling extensions).
    Unknown fields are kept (`model_extra`) so that the routes can refuse the
    ones in UNSUPPORTED_FIELDS."""

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True, allow_inf_nan=False)

    model: Optional[Text] = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=-1, le=MAX_INT)
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    seed: Optional[int] = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: Optional[Union[StopString, Annotated[list[StopString], Field(max_length=MAX_STOP)]]] = None
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: Optional[float] = Field(None, gt=0.0, le=10.0)
    logit_bias: Optional[Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]],
                                   Field(max_length=MAX_LOGIT_BIAS_ENTRIES)]] = None
    user: Optional[Annotated[str, Field(max_length=512), AfterValidator(_utf8)]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False
    response_format: Optional[ResponseFormat] = None
    # stepserve's extension: this request's SLOs in seconds, for the step policies (TAPER)
    slo_ttft: Optional[Seconds] = None
    slo_tpot: Optional[Seconds] = None
    # stepserve's extension: false opts this request out of speculative decoding
    speculative: bool = True
    # vLLM's extensions
    stop_token_ids: Optional[Annotated[list[TokenId], Field(max_length=64)]] = None
    min_tokens: int = Field(0, ge=0, le=MAX_INT)
    include_stop_str_in_output: bool = False  # a matched stop string (or stop token's text) stays in the text
    skip_special_tokens: bool = True  # false: special tokens' text is in the output text
    structured_outputs: Optional[StructuredOutputs] = None
    guided_json: Optional[Union[JsonObject, Text]] = None  # vLLM's older names for the same
    guided_regex: Optional[Text] = None
    guided_choice: Optional[Annotated[list[Text], Field(min_length=1, max_length=1024)]] = None
    guided_grammar: Optional[Text] = None
    truncate_prompt_tokens: Optional[int] = Field(None, ge=1, le=MAX_INT)  # keep the prompt's last N tokens
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # top alternatives per prompt token
    regex: Optional[Text] = None  # SGLang's name for a regex constraint
    allowed_token_ids: Optional[Annotated[list[TokenId], Field(min_length=1, max_length=1 << 17)]] = None

    def constraint(self) -> tuple[str, object, str] | None:
        """(kind, spec, field) of the request's one output constraint, from
        response_format, structured_outputs or a guided_* field (None: none);
        ValueError if it gives more than one."""
        found = []
        try:
            self._constraints(found)
        except ValueError as e:
            raise ConstraintError(str(e), found[-1][2] if found else "structured_outputs") from None
        if len(found) > 1:
            raise ConstraintError(f"{found[0][2]} and {found[1][2]} both constrain the output: give one", found[1][2])
        return found[0] if found else None

    def _constraints(self, found: list) -> None:
        rf = self.response_format
        if rf is not None and rf.type != "text":
            found.append(("json", {"type": "object"} if rf.type == "json_object" else rf.json_schema.schema_,
                          "response_format"))
        if self.structured_outputs is not None:
            found.append((None, None, "structured_outputs"))
            found[-1] = (*self.structured_outputs.constraint(), "structured_outputs")
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar"), ("regex", "regex")):
            v = getattr(self, name)
            if v is not None:
                found.append((None, None, name))
                found[-1] = (*StructuredOutputs(**{key: v}).constraint(), name)


class ConstraintError(ValueError):
    """A request's output constraints do not make one constraint; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


Prompt = Union[
    Text,
    Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)],
    Annotated[list[TokenId], Field(min_length=1)],
    Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)],
]


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: Optional[int] = Field(None, ge=1, le=MAX_INT)
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    best_of: Optional[int] = Field(None, ge=1, le=MAX_N)
    suffix: Optional[Text] = None
    # vLLM's beam search (server/beam_search.py): n beams, ranked by logprob / length ** length_penalty
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, ge=-10.0, le=10.0)
    add_special_tokens: bool = True  # vLLM's: a text prompt gets the tokenizer's special tokens (a BOS)


class TextPart(_Model):
    type: Literal["text"]
    text: Text


class FunctionCall(_Model):
    name: Text
    arguments: Text  # JSON text, as OpenAI sends it


class ToolCallMessage(_Model):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(_Model):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Optional[Text] = None
    parameters: Optional[JsonObject] = None
    strict: Optional[bool] = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Model):
    name: Text


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Model):
    role: Annotated[str, Field(min_length=1, max_length=64), AfterValidator(_utf8)]  # any role the template takes
    content: Optional[Union[Text, list[TextPart]]] = None
    name: Optional[Text] = None
    tool_call_id: Optional[Text] = None
    tool_calls: Optional[Annotated[list[ToolCallMessage], Field(max_length=128)]] = None  # an assistant's calls

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Optional[int] = Field(None, ge=1, le=MAX_INT)
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=MAX_INT)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True
    # vLLM's extensions: the last (assistant) message is continued rather than closed, and
    # echo puts that message's content in front of the answer
    continue_final_message: bool = False
    echo: bool = False
    chat_template_kwargs: Optional[JsonObject] = None  # extra variables for the chat template (enable_thinking, ...)
    tools: Optional[Annotated[list[Tool], Field(max_length=128)]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: bool = True
    add_special_tokens: bool = False  # vLLM's: the tokenizer's special tokens on top of the template's


class _NativeModel(_Model):
    """`POST /generate`'s bodies: every field is one of the engine's own, so an
    unknown one (a typo, another server's name such as SGLang's
    `max_new_tokens`) is a 400 naming it, not silently dropped."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True, allow_inf_nan=False)


# SGLang's sampling names on /generate -> the engine's
SGLANG_ALIASES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
                  "no_stop_trim": "include_stop_str_in_output"}


class NativeSamplingParams(_NativeModel):
    """`POST /generate`'s sampling parameters: the engine's own names."""

    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: Optional[int] = Field(16, ge=1, le=MAX_INT)
    min_tokens: int = Field(0, ge=0, le=MAX_INT)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=MAX_INT)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: Optional[int] = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: Optional[Union[StopString, Annotated[list[StopString], Field(max_length=MAX_STOP)]]] = None
    stop_token_ids: Optional[Annotated[list[TokenId], Field(max_length=64)]] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    logit_bias: Optional[Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]],
                                   Field(max_length=MAX_LOGIT_BIAS_ENTRIES)]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    json_schema: Optional[Union[JsonObject, Text]] = None  # constrain the output to this JSON schema (or its text)
    speculative: bool = True  # false: this request never decodes speculatively
    # SGLang's names (its /generate): max_new_tokens, min_new_tokens and no_stop_trim for max_tokens,
    # min_tokens and include_stop_str_in_output; a regex constraint; spaces between special tokens (the only way)
    max_new_tokens: Optional[int] = Field(None, ge=1, le=MAX_INT)
    min_new_tokens: Optional[int] = Field(None, ge=0, le=MAX_INT)
    no_stop_trim: Optional[bool] = None
    regex: Optional[Text] = None
    spaces_between_special_tokens: Literal[True] = True

    @model_validator(mode="after")
    def _one_name_each(self):
        for sglang, ours in SGLANG_ALIASES.items():
            if getattr(self, sglang) is not None and ours in self.model_fields_set:
                raise ValueError(f"give {ours} or {sglang}, not both")
        if self.json_schema is not None and self.regex is not None:
            raise ValueError("give json_schema or regex, not both")
        return self

    def engine_kwargs(self) -> dict:
        """SamplingParams' keywords (the constraints left out: the route compiles them)."""
        kw = self.model_dump(exclude={"json_schema", "regex", "spaces_between_special_tokens", *SGLANG_ALIASES})
        for sglang, ours in SGLANG_ALIASES.items():
            if getattr(self, sglang) is not None:
                kw[ours] = getattr(self, sglang)
        return kw


class StageBranch(_NativeModel):
    prompt: Union[Text, list[TokenId]] = ""  # the branch's own suffix
    max_tokens: int = Field(ge=1, le=MAX_INT)


class Stage(_NativeModel):
    """A fork/join stage after the first: serial (`max_tokens`) or parallel (`branches`)."""

    max_tokens: Optional[int] = Field(None, ge=1, le=MAX_INT)
    branches: Optional[Annotated[list[StageBranch], Field(min_length=1, max_length=MAX_STAGE_BRANCHES)]] = None

    @model_validator(mode="after")
    def _one_kind(self):
        if (self.max_tokens is None) == (self.branches is None):
            raise ValueError("give either max_tokens (a serial stage) or branches (a parallel stage)")
        return self

    def engine_dict(self) -> dict:
        if self.branches is None:
            return {"max_tokens": self.max_tokens}
        return {"branches": [{"prompt": b.prompt, "max_tokens": b.max_tokens} for b in self.branches]}


SGLANG_SAMPLING_FIELDS = frozenset(SGLANG_ALIASES) | {"regex", "spaces_between_special_tokens"}
SGLANG_REQUEST_FIELDS = frozenset({
    "rid", "return_logprob", "top_logprobs_num", "logprob_start_len", "return_text_in_logprobs", "lora_path",
    "image_data", "audio_data", "video_data", "input_embeds", "custom_logit_processor", "token_ids_logprob",
    "return_hidden_states", "return_routed_experts", "log_metrics"})


class GenerateRequest(_NativeModel):
    """`POST /generate`: exactly one of `text` and `input_ids`; `stages` makes
    it a fork/join request (`Engine.add_request`)."""

    text: Optional[Text] = None
    input_ids: Optional[Annotated[list[TokenId], Field(min_length=1)]] = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    model: Optional[Text] = None
    stages: Optional[Annotated[list[Stage], Field(min_length=1, max_length=MAX_STAGES)]] = None
    slo_ttft: Optional[Seconds] = None  # this request's SLOs in seconds, for the step policies (TAPER)
    slo_tpot: Optional[Seconds] = None
    # SGLang's: the id its answer reports, and logprobs its way (return_logprob, top_logprobs_num
    # alternatives, the prompt's from logprob_start_len on; -1: none of the prompt's)
    rid: Optional[Annotated[str, Field(min_length=1, max_length=256), AfterValidator(_utf8)]] = None
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    logprob_start_len: int = Field(-1, ge=-1, le=MAX_INT)
    return_text_in_logprobs: bool = False
    # SGLang's fields that its clients send at their absent values (bench_serving sends lora_path null):
    # accepted so, any other value is a 400 naming the field
    lora_path: None = None
    image_data: None = None
    audio_data: None = None
    video_data: None = None
    input_embeds: None = None
    custom_logit_processor: None = None
    token_ids_logprob: None = None
    return_hidden_states: Literal[False] = False
    return_routed_experts: Literal[False] = False
    log_metrics: bool = True  # (changes nothing here)

    def sglang_shaped(self) -> bool:
        """Whether the request names any of SGLang's fields (its sampling names
        included): its stream then carries SGLang's view in every event."""
        sp = self.sampling_params
        return bool(self.model_fields_set & SGLANG_REQUEST_FIELDS
                    or sp.model_fields_set & SGLANG_SAMPLING_FIELDS or isinstance(sp.json_schema, str))

    @model_validator(mode="after")
    def _one_prompt(self):
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of 'text' and 'input_ids'")
        sp = self.sampling_params
        if self.return_logprob and (sp.logprobs is not None or sp.prompt_logprobs is not None):
            raise ValueError("give return_logprob or sampling_params.logprobs / prompt_logprobs, not both")
        return self


class TokenizeRequest(_Model):
    """vLLM's `POST /tokenize`: a text (`prompt`, as /v1/completions takes it)
    or a conversation (`messages`, as chat renders it), one or the other."""

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True, allow_inf_nan=False)

    model: Optional[Text] = None
    prompt: Optional[Text] = None
    messages: Optional[Annotated[list[ChatMessage], Field(min_length=1)]] = None
    add_special_tokens: Optional[bool] = None  # None: the route's default (true for a prompt, false for messages)
    return_token_strs: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[JsonObject] = None
    tools: Optional[Annotated[list[Tool], Field(max_length=128)]] = None

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(_Model):
    """vLLM's `POST /detokenize`: token ids back to text."""

    model: Optional[Text] = None
    tokens: Annotated[list[TokenId], Field(max_length=1 << 20)]
