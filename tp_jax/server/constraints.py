"""The request fields that constrain an answer (pydantic), and the engine's StructuredOutputsParams from them.

* `ResponseFormat` — OpenAI's `response_format`: `{"type": "text"}`, `{"type": "json_object"}` or
  `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`.
* `StructuredOutputsRequest` — vLLM's `structured_outputs` extra field: one of `json`, `regex`,
  `choice`, `grammar`, `json_object`, with vLLM's whitespace / additional-properties options.
* `Tool`, `NamedToolChoice` — OpenAI's `tools` and a `tool_choice` naming one function.
* `request_constraint(request)` — the StructuredOutputsParams those ask for (None: free text);
  a `required` or named `tool_choice` constrains the answer too (tp_jax/server/tools.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tp_jax.serving.structured import StructuredOutputsParams


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def params(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.json_schema is None:
            raise ValueError('response_format: type "json_schema" needs a "json_schema": {"name": ..., "schema": '
                             '{...}} object')
        # strict (OpenAI): objects take only their declared properties unless the schema says otherwise
        return StructuredOutputsParams(json=self.json_schema.json_schema,
                                       disable_additional_properties=bool(self.json_schema.strict))


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` request field (its StructuredOutputsParams)."""
    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.json_, regex=self.regex, choice=self.choice, grammar=self.grammar,
                                       json_object=self.json_object or None,
                                       disable_any_whitespace=self.disable_any_whitespace,
                                       disable_additional_properties=self.disable_additional_properties,
                                       whitespace_pattern=self.whitespace_pattern)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: FunctionName


def request_constraint(request, tool_constraint: StructuredOutputsParams | None = None
                       ) -> tuple[str, StructuredOutputsParams] | None:
    """(the field, the StructuredOutputsParams) of the one constraint a request asks for, or None;
    `tool_constraint`: what its tool_choice asks for. ValueError when it asks for two, or a bad one."""
    asked = []
    for field in ("response_format", "structured_outputs"):
        given = getattr(request, field, None)
        try:
            p = None if given is None else given.params()
        except ValueError as e:
            raise ConstraintError(field, str(e).removeprefix("StructuredOutputsParams: ")) from None
        if p is not None:
            asked.append((field, p))
    if tool_constraint is not None:
        asked.append(("tool_choice", tool_constraint))
    if len(asked) > 1:
        raise ConstraintError(asked[0][0], f"{' and '.join(n for n, _ in asked)} each constrain the answer; "
                                           f"send only one of them")
    return asked[0] if asked else None


class ConstraintError(ValueError):
    """A bad or conflicting constraint; `param` names the request field."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param
