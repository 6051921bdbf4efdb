"""URLs of engines and servers: checked when they arrive, joined with a URL library, and never shown with their
secrets.

An engine or reward-server URL may carry credentials (``http://user:password@host``) or a token in its query
(``?token=...``). Relax keeps the URL whole to reach the server, and shows only `redact_url`'s form anywhere a person
or another client can read it (HTTP answers, logs, errors, run.log): the user-info and every query value become
``***``. A path is joined to a URL by its path, so the query stays a query (``http://h/p?token=x`` + ``/health`` is
``http://h/p/health?token=x``, not ``http://h/p?token=x/health``).
"""

from __future__ import annotations

import re

import httpx

REDACTED = "***"
# URLs inside free text (an error message, an answer body): scheme, then anything up to whitespace or a quote.
_URL_IN_TEXT = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]*[^\s'\"<>.,:;)\]]")


def parse_http_url(text: str) -> httpx.URL:
    """``text`` as an absolute http(s) URL with a host; ValueError saying what is wrong (without echoing a
    secret)."""
    try:
        url = httpx.URL(text)
    except (httpx.InvalidURL, TypeError, ValueError):
        raise ValueError("is not a URL") from None
    if url.scheme not in ("http", "https"):
        # Only a real scheme is named: in "user:password@host" the parser's "scheme" is the user name.
        named = (f" (scheme {url.scheme})" if url.scheme and f"{url.scheme}://" in text.lower()
                 else " (no scheme://; e.g. http://HOST:PORT)" if "://" not in text else "")
        raise ValueError("is not an http:// or https:// URL" + named)
    if not url.host:
        raise ValueError("has no host")
    if url.port is not None and not 1 <= url.port <= 65535:
        raise ValueError(f"has port {url.port}, outside 1-65535")
    if url.fragment:
        raise ValueError("must not have a #fragment")
    return url


def redact_url(url: str | httpx.URL) -> str:
    """``url`` without its secrets: user-info, every query value and the fragment replaced by ``***`` (the names of
    query parameters stay, so a reader sees that a token was given). Text that is not ``scheme://host...`` is
    ``***`` whole: without a host the parser cannot tell where credentials are (``user:password@host:8000`` reads
    as scheme ``user`` and a path holding the password), so no part of it is shown."""
    try:
        parsed = httpx.URL(str(url))
    except (httpx.InvalidURL, TypeError, ValueError):
        return REDACTED
    if not parsed.host:
        return REDACTED
    if parsed.fragment:
        parsed = parsed.copy_with(fragment=REDACTED)
    if parsed.userinfo:
        parsed = parsed.copy_with(username=REDACTED, password=None)
    if parsed.query:
        names = [name for name, _ in parsed.params.multi_items()]
        parsed = parsed.copy_with(query="&".join(f"{name}={REDACTED}" for name in names).encode())
    return str(parsed)


def redact_urls_in(text: str) -> str:
    """Every URL inside ``text`` redacted (`redact_url`)."""
    return _URL_IN_TEXT.sub(lambda match: redact_url(match.group(0)), text)


def join_url(base: str | httpx.URL, path: str) -> str:
    """``path`` (``/health``) appended to ``base``'s path; ``base``'s query and credentials are kept."""
    parsed = httpx.URL(str(base))
    return str(parsed.copy_with(path=parsed.path.rstrip("/") + "/" + path.lstrip("/")))


def url_secrets(url: str | httpx.URL) -> list[str]:
    """The secret parts of ``url`` (password, user name, query values), to be scrubbed from text a server sent back
    (an error body that echoes its request: `scrub`)."""
    try:
        parsed = httpx.URL(str(url))
    except (httpx.InvalidURL, TypeError, ValueError):
        return []
    parts = [parsed.username, parsed.password, *(value for _, value in parsed.params.multi_items())]
    return [part for part in parts if part and len(part) >= 3]  # a 1-2 character value would scrub at random


def scrub(text: str, secrets: list[str]) -> str:
    """``text`` with its URLs redacted and every secret replaced by ``***``."""
    text = redact_urls_in(text)
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return text
