"""A reward served over HTTP (``--rm-url``, upstream's ``remote_rm``): POST ``{"prompt", "response", "label",
"metadata"}`` to the URL, read back a number (or an object with ``"reward"`` or ``"score"``).

A reward server is a network service, and such services fail for a moment: a refused connection, a dropped one, a
timeout, a 5xx or a 429 is retried with exponential backoff (0.5 s, doubling, at most 30 s between attempts, at
most 10 attempts, upstream's numbers), inside the one bound of ``--reward-timeout`` that every reward call has
(`RewardComputer`). Any other 4xx is the request's fault and is not retried. The URL may carry a token (a query
parameter, ``user:password@``): errors and logs show it redacted (`relax.utils.urls`), and a server's answer quoted
in an error has every URL and every secret of the URL scrubbed from it (a server may echo its request).
"""

from __future__ import annotations

import asyncio
import logging
import math
import numbers
import weakref
from typing import Any

import httpx

from relax.utils.urls import parse_http_url, redact_url, scrub, url_secrets

logger = logging.getLogger("relax.rewards")

REMOTE_RM_TYPE = "remote_rm"  # upstream's --rm-type of this reward
MAX_ATTEMPTS = 10
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class RemoteRewardError(RuntimeError):
    """The reward server refused the request or answered something that is not a reward."""


class RemoteReward:
    """``await reward(args, sample) -> float`` against a reward server; `pop_metrics` gives the attempts retried
    since its last call (``reward/remote_retries``)."""

    def __init__(self, url: str, *, max_attempts: int = MAX_ATTEMPTS, first_backoff_s: float = FIRST_BACKOFF_S,
                 max_backoff_s: float = MAX_BACKOFF_S, request_timeout_s: float = 60.0) -> None:
        try:
            parse_http_url(url)
        except ValueError as error:
            raise ValueError(f"--rm-url {redact_url(url)}: {error}; expected the http(s) URL of a reward "
                             "server") from None
        self.url = url
        self.name = redact_url(url)
        self._secrets = url_secrets(url)
        self.max_attempts = max_attempts
        self.first_backoff_s = first_backoff_s
        self.max_backoff_s = max_backoff_s
        self.request_timeout_s = request_timeout_s
        self.retries = 0
        self._clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a client belongs to its loop

    def pop_metrics(self) -> dict[str, int]:
        retries, self.retries = self.retries, 0
        return {"reward/remote_retries": retries}

    async def __call__(self, args: Any, sample: Any) -> float:
        payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label,
                   "metadata": sample.metadata}
        backoff = self.first_backoff_s
        for attempt in range(1, self.max_attempts + 1):
            try:
                answer = await self._client().post(self.url, json=payload, timeout=self.request_timeout_s)
            except httpx.HTTPError as err:  # refused, reset, timed out: the server may be back in a moment
                problem = f"{type(err).__name__}"
            else:
                if answer.status_code < 400:
                    return self._reward_of(answer)
                if answer.status_code not in RETRY_STATUS:
                    raise RemoteRewardError(f"reward server {self.name} answered {answer.status_code}: "
                                            f"{scrub(answer.text[:200], self._secrets)}")
                problem = f"HTTP {answer.status_code}"
            if attempt == self.max_attempts:
                raise RemoteRewardError(f"reward server {self.name} failed {attempt} times (last: {problem})")
            self.retries += 1
            logger.debug("reward server %s: %s; attempt %d of %d in %.1f s", self.name, problem, attempt + 1,
                         self.max_attempts, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.max_backoff_s)
        raise AssertionError("unreachable")

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            client = self._clients[loop] = httpx.AsyncClient()
        return client

    def _reward_of(self, answer: httpx.Response) -> float:
        try:
            body = answer.json()
        except ValueError:
            raise RemoteRewardError(f"reward server {self.name} answered no JSON: "
                                    f"{scrub(answer.text[:200], self._secrets)!r}") from None
        value = body.get("reward", body.get("score")) if isinstance(body, dict) else body
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RemoteRewardError(f"reward server {self.name} answered {scrub(str(body)[:200], self._secrets)}: "
                                    "expected a number, or "
                                    "an object with a numeric \"reward\" or \"score\"")
        return float(value)
