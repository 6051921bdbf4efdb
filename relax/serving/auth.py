"""Bearer-token checks shared by every HTTP server Relax starts (`relax serve`, the scaling API)."""

from __future__ import annotations

import secrets
from collections.abc import Callable

from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException


def token_matches(given: str, expected: str) -> bool:
    """Constant-time comparison of any two strings: header values arrive decoded as latin-1 and may hold any byte,
    which `secrets.compare_digest` refuses for non-ASCII `str` (a 500 before authentication); bytes it takes."""
    return secrets.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode("utf-8", "surrogatepass"))


def bearer_token_dependency(api_key: str | None) -> Callable[..., None]:
    """A FastAPI dependency that answers 401 unless ``Authorization: Bearer <api_key>`` is sent (no check when
    ``api_key`` is empty or None). The key is never echoed."""
    bearer = HTTPBearer(auto_error=False)

    def require_token(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:  # noqa: B008
        if not api_key:
            return
        if credentials is None or not token_matches(credentials.credentials, api_key):
            raise HTTPException(401, "missing or wrong bearer token (Authorization: Bearer <api key>)")

    return require_token
