"""Structured output fields -> one grammar: OpenAI's response_format, vLLM's guided_* and
structured_outputs. A schema, regex or grammar the library cannot compile is a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Callable, TypeVar

import jsonschema

from backfill.engine.grammar import GrammarCompiler, InvalidGrammarError
from backfill.server.errors import bad_request
from backfill.server.schemas import ChatCompletionBody, CompletionBody

JSON_OBJECT_SCHEMA = {"type": "object"}

Value = TypeVar("Value")
Built = TypeVar("Built")


def requested_grammar(body: ChatCompletionBody | CompletionBody) -> tuple[str, str] | None:
    """(field name, llguidance grammar) of the one structured-output field the body sets, or None."""
    found: list[tuple[str, str]] = []
    response_format = body.response_format
    if response_format is not None and response_format.type == "json_object":
        found.append(("response_format", GrammarCompiler.json_schema(JSON_OBJECT_SCHEMA)))
    elif response_format is not None and response_format.type == "json_schema":
        schema = response_format.json_schema.schema_
        found.append(("response_format", _schema_grammar(JSON_OBJECT_SCHEMA if schema is None else schema,
                                                         "response_format")))
    if body.guided_json is not None:
        found.append(("guided_json", _schema_grammar(body.guided_json, "guided_json")))
    if body.guided_regex is not None:
        found.append(("guided_regex", GrammarCompiler.regex(body.guided_regex)))
    if body.guided_choice is not None:
        found.append(("guided_choice", _checked(GrammarCompiler.choice, body.guided_choice, "guided_choice")))
    if body.guided_grammar is not None:
        found.append(("guided_grammar", _checked(GrammarCompiler.lark, body.guided_grammar, "guided_grammar")))
    outputs = body.structured_outputs
    if outputs is not None:
        if outputs.json_ is not None:
            found.append(("structured_outputs", _schema_grammar(outputs.json_, "structured_outputs")))
        if outputs.json_object:
            found.append(("structured_outputs", GrammarCompiler.json_schema(JSON_OBJECT_SCHEMA)))
        if outputs.regex is not None:
            found.append(("structured_outputs", GrammarCompiler.regex(outputs.regex)))
        if outputs.choice is not None:
            found.append(("structured_outputs", _checked(GrammarCompiler.choice, outputs.choice, "structured_outputs")))
        if outputs.grammar is not None:
            found.append(("structured_outputs", _checked(GrammarCompiler.lark, outputs.grammar, "structured_outputs")))
    if len(found) > 1:
        raise bad_request(f"at most one structured-output constraint per request; got {', '.join(f for f, _ in found)}",
                          param=found[1][0])
    return found[0] if found else None


def check_tool_schemas(compiler: GrammarCompiler, body: ChatCompletionBody, forced: bool) -> None:
    """Each tool's parameters: a valid JSON schema (400 naming tools[i].function.parameters and what
    is wrong in it), and, when a tool call is forced (the schemas become the output's grammar), one
    the grammar library compiles; never the combined grammar's internals in the message."""
    for index, tool in enumerate(body.tools or ()):
        if tool.function.parameters is None:
            continue
        param = f"tools[{index}].function.parameters"
        grammar = _schema_grammar(tool.function.parameters, param)
        if forced:
            check_grammar(compiler, param, grammar)


def _schema_grammar(schema: object, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise bad_request(f"{param}: the schema is not valid JSON: {exc}", param=param) from None
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"{param}: a JSON schema must be an object", param=param)
    try:
        # The meta-schema names what is wrong ({"type": "strin"}) before the grammar library sees it.
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise bad_request(f"{param}: invalid JSON schema at {where}: {exc.message}", param=param) from None
    return _checked(GrammarCompiler.json_schema, schema, param)


def _checked(build: Callable[[Value], Built], value: Value, param: str) -> Built:
    """build(value), its InvalidGrammarError a 400 naming param."""
    try:
        return build(value)
    except InvalidGrammarError as exc:
        raise bad_request(f"{param}: {exc}", param=param) from None


def check_grammar(compiler: GrammarCompiler, param: str, grammar: str) -> None:
    """400 naming param when the grammar does not compile for this model's tokenizer."""
    _checked(compiler.check, grammar, param)
