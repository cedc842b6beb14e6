"""The server's OpenAPI document, served at /openapi.json: FastAPI's own, with the request body
of each POST route that parses one (`app.parse_body` reads bodies itself, so FastAPI cannot see
them) taken from its pydantic model. Clients and fuzzers (tests/test_fuzz_server.py) read it."""
from __future__ import annotations

import warnings
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


def body_models() -> dict[str, type[BaseModel]]:
    """The model each POST route's body is parsed with."""
    from slipstream.server.protocol import (ChatCompletionRequest, CompletionRequest,
                                            DetokenizeRequest, TokenizeRequest)
    return {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
            "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """The document (built once per app)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    from slipstream.version import __version__
    with warnings.catch_warnings():  # /health answers GET and HEAD: one function, two operations
        warnings.filterwarnings("ignore", "Duplicate Operation ID", UserWarning)
        doc = get_openapi(title=app.title, version=__version__, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for path, model in body_models().items():
        operation = doc["paths"].get(path, {}).get("post")
        if operation is None:
            continue
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        operation["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    app.openapi_schema = doc
    return doc
