"""OpenAPI descriptions of the routes that parse their own bodies (so clients and fuzzers see them).

The completion routes read the raw body themselves (to answer every problem with an OpenAI error
and to check the size first), so FastAPI cannot infer their request schema; these helpers state it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

_REF = "#/$defs/"


def inline_schema(model: type[BaseModel]) -> dict[str, Any]:
    """`model`'s JSON schema with every local `$ref` replaced by its definition.

    The schema is embedded in an operation, where `#/$defs/...` would not resolve. Our request
    models are not recursive, so full inlining terminates.
    """
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith(_REF):
                rest = {k: v for k, v in node.items() if k != "$ref"}
                return {**resolve(defs[ref[len(_REF):]]), **resolve(rest)}
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    resolved: dict[str, Any] = resolve(schema)
    return resolved


_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": ["string", "null"]}},
    }},
}


def _error(description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": _ERROR_SCHEMA}}}


def completion_openapi(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` of a completion route: its JSON body and its error answers."""
    return {
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": inline_schema(model)}}},
        "responses": {
            "400": _error("invalid request (bad field, too many messages, prompt too long)"),
            "401": _error("missing or wrong API key"),
            "404": _error("unknown model"),
            "413": _error("request body larger than --max-request-size"),
            "429": _error("rejected early: the SLOs cannot be met now (see Retry-After)"),
            "503": _error("no instance of a needed role is alive"),
        },
    }
