"""Bearer-token authentication of the write endpoints: who acts, checked before the body is read.

A route class rather than a dependency, because FastAPI judges a body before any dependency runs and an
unauthenticated client must get 401, not a 422 describing the body it should have sent.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Coroutine
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request, Response
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from stepstream.http.settings import ApiSettings

_BEARER = HTTPBearer(auto_error=False, description="a token of STEPSTREAM_API_TOKENS")


class BearerTokens:
    """The configured tokens, by who holds them. A request's token is checked before its body is read, so
    without a valid one the answer is 401 whatever the body (FastAPI judges bodies before dependencies).
    No token configured: no writes at all."""

    def __init__(self, settings: ApiSettings) -> None:
        self._tokens = [(name, secret.get_secret_value().encode()) for name, secret in settings.tokens.items()]

    def holder(self, authorization: str | None) -> str:
        """The name of the token presented in an ``Authorization`` header; HTTP 401 if none matches."""
        if not self._tokens:
            raise _unauthorized("writes are disabled: no API token is configured (STEPSTREAM_API_TOKENS)")
        scheme, _, presented = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            raise _unauthorized("missing bearer token (Authorization: Bearer <token>)")
        candidate = presented.strip().encode()
        # Every token is compared, in constant time each, so timing tells nothing about which one is near.
        matches = [name for name, secret in self._tokens if hmac.compare_digest(candidate, secret)]
        if not matches:
            raise _unauthorized("invalid bearer token")
        return matches[0]

    def route_class(self, max_body_bytes: int) -> type[APIRoute]:
        """Routes that check the token first, then the declared body size, then hand over to FastAPI."""
        tokens = self

        class AuthenticatedRoute(APIRoute):
            def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
                handler = super().get_route_handler()

                async def authenticated(request: Request) -> Response:
                    request.state.token_holder = tokens.holder(request.headers.get("authorization"))
                    declared = request.headers.get("content-length", "0")
                    if not declared.isdigit() or int(declared) > max_body_bytes:
                        raise HTTPException(413, f"the body may have at most {max_body_bytes} bytes "
                                                 "(STEPSTREAM_API_MAX_BODY_BYTES)")
                    return await handler(request)

                return authenticated

        return AuthenticatedRoute


def token_holder(request: Request,
                 _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)]) -> str:
    """Who acts: the holder of the request's token (checked by the route; the dependency documents the
    bearer scheme in the OpenAPI schema)."""
    holder: str = request.state.token_holder
    return holder


def _unauthorized(detail: str) -> HTTPException:
    return HTTPException(401, detail, headers={"WWW-Authenticate": "Bearer"})
