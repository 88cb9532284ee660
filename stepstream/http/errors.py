"""The 422 the front raises for a value it refuses on its own, shaped like FastAPI's so every client reads
one error format whether FastAPI or the front judged the request."""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError


def invalid(parameter: str, message: str, value: Any, where: str = "query") -> RequestValidationError:
    """A 422 shaped like FastAPI's own, naming the parameter (or body field, ``input.amount`` for a nested
    one) at fault."""
    return RequestValidationError([{"type": "value_error", "loc": (where, *parameter.split(".")), "msg": message,
                                    "input": value}])
