"""`relax scale`: the client of the rollout engines' scaling API (docs/engines.md).

    relax scale out --url http://127.0.0.1:8100 --num-replicas 3        # ray_native-style: 3 engines in all
    relax scale out --url URL --engine-urls http://10.0.0.7:30000        # connect an external engine
    relax scale in  --url URL --num-replicas 1 [--force] [--dry-run]
    relax scale engines --url URL
    relax scale status --url URL {out|in} REQUEST_ID

A scale request gets a request id (yours with --request-id, or a fresh one) and is retried with that same id when
the connection fails, so a retry never starts a second operation; the command then polls the operation until it
ends and prints it. The bearer token comes from --api-key or RELAX_API_KEY and is never printed.
Exit status: 0 for ACTIVE, COMPLETED or NOOP; 1 for FAILED, CANCELLED or REJECTED; 2 for a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid

import httpx

from relax.cli.args import CommandLineParser
from relax.cli.common import in_range, positive
from relax.utils.urls import parse_http_url, redact_url

TERMINAL = {"ACTIVE", "COMPLETED", "NOOP", "FAILED", "CANCELLED", "REJECTED"}
SUCCESS = {"ACTIVE", "COMPLETED", "NOOP"}
RETRIES = 5  # a scale request (idempotent by its request id): the API may be restarting
GET_RETRIES = 2  # a question: asked again once
POLL_MARGIN_S = 60.0  # beyond an operation's timeout_secs: the API's removal of what it added, then its answer


def build_parser() -> argparse.ArgumentParser:
    parser = CommandLineParser(prog="relax scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["out", "in", "engines", "status"])
    parser.add_argument("args", nargs="*", help="status: out|in REQUEST_ID")
    parser.add_argument("--url", required=True, type=_api_url, help="the scaling API, e.g. http://127.0.0.1:8100")
    parser.add_argument("--num-replicas", type=in_range(int, 0, 1_000_000), help="out: engines wanted in all; in: engines that remain")
    parser.add_argument("--engine-urls", nargs="*", default=[], help="external engines to connect or remove")
    parser.add_argument("--force", action="store_true", help="in: do not wait for the engines' requests")
    parser.add_argument("--dry-run", action="store_true", help="in: show what would be removed")
    parser.add_argument("--drain-timeout", type=positive(float), help="in: seconds to wait for the engines' requests")
    parser.add_argument("--start-timeout", type=positive(float),
                        help="out: seconds the new engines may take to start, load the model and the weights (the "
                             "API's timeout_secs; default 300 for replicas); the operation fails after, removing them")
    parser.add_argument("--request-id", help="idempotency key (default: a new one)")
    parser.add_argument("--timeout", type=positive(float), default=600.0, help="give up polling after this many seconds")
    parser.add_argument("--api-key", default=os.environ.get("RELAX_API_KEY"), help="bearer token (default $RELAX_API_KEY)")
    return parser


def _api_url(text: str) -> str:
    """--url as an http(s) URL; refused at once (not retried as an unreachable API), without echoing a secret."""
    try:
        parse_http_url(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{redact_url(text)} {err}") from None
    return text


class APIUnreachable(Exception):
    """The scaling API did not answer (it is down, or the URL is wrong)."""


def _request(client: httpx.Client, method: str, path: str, body: dict | None = None,
             retries: int = RETRIES) -> httpx.Response:
    """The answer to one request, retried while the connection fails (a scale request keeps its request id, so a
    retry never starts a second operation)."""
    for attempt in range(retries):
        try:
            return client.request(method, path, json=body)
        except httpx.TransportError as err:
            if attempt == retries - 1:
                raise APIUnreachable(f"{redact_url(client.base_url)}{path}: no answer after {retries} tries "
                                     f"({type(err).__name__}); is the run's scaling API up (--rollout-api-port)?") \
                    from None
            time.sleep(min(2**attempt * 0.5, 5.0))
    raise AssertionError("unreachable")


def _json(response: httpx.Response, what: str, needs: str | None = None) -> dict:
    """The answer's JSON object (with the field ``needs``); anything else means --url is not the scaling API."""
    if response.status_code != 200:
        raise APIUnreachable(f"{what}: HTTP {response.status_code}: {response.text[:300]}")
    try:
        answer = response.json()
    except ValueError:
        answer = None
    if not isinstance(answer, dict) or (needs is not None and needs not in answer):
        found = f"no {needs!r} in it" if isinstance(answer, dict) else "not a JSON object"
        raise APIUnreachable(f"{what}: the answer is not the scaling API's ({found}); is --url the run's "
                             "--rollout-api-port?")
    return answer


def _poll(client: httpx.Client, kind: str, request_id: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        operation = _json(_request(client, "GET", f"/{kind}/{request_id}"), f"{kind} {request_id}", "status")
        if operation["status"] in TERMINAL:
            return operation
        if time.monotonic() > deadline:
            raise APIUnreachable(f"{kind} {request_id} still {operation['status']} after {timeout_s:g} s")
        time.sleep(0.2)


def main(argv: list[str]) -> int:
    args = build_parser().parse_intermixed_args(argv)  # options before or after the action and its arguments
    try:
        return _run(args)
    except APIUnreachable as err:
        print(f"relax scale {args.action}: {err}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=args.url.rstrip("/"), headers=headers, timeout=60) as client:
        if args.action == "engines":
            print(json.dumps(_json(_request(client, "GET", "/engines", retries=GET_RETRIES), "engines"), indent=2))
            return 0
        if args.action == "status":
            if len(args.args) != 2 or args.args[0] not in ("out", "in"):
                print("relax scale status: give out|in and a request id", file=sys.stderr)
                return 2
            path = f"/scale_{args.args[0]}/{args.args[1]}"
            print(json.dumps(_json(_request(client, "GET", path, retries=GET_RETRIES), path, "status"), indent=2))
            return 0
        if args.num_replicas is None and not args.engine_urls:
            print(f"relax scale {args.action}: give --num-replicas or --engine-urls", file=sys.stderr)
            return 2
        kind = f"scale_{args.action}"
        body = {"engine_urls": args.engine_urls, "request_id": args.request_id or f"cli-{uuid.uuid4().hex[:12]}"}
        if args.num_replicas is not None:
            body["num_replicas"] = args.num_replicas
        if args.action == "in":
            body.update(force=args.force, dry_run=args.dry_run)
        operation_timeout = args.drain_timeout if args.action == "in" else args.start_timeout
        if operation_timeout is not None:
            body["timeout_secs"] = operation_timeout
        response = _request(client, "POST", f"/{kind}", body)
        if response.status_code != 200:
            print(f"relax scale {args.action}: HTTP {response.status_code}: {response.text}", file=sys.stderr)
            return 1
        # the polling outlasts the operation's own bound, which then ends it FAILED with the reason
        poll_s = max(args.timeout, (operation_timeout or 0.0) + POLL_MARGIN_S)
        operation = _poll(client, kind, _json(response, kind, "request_id")["request_id"], poll_s)
    print(json.dumps(operation, indent=2))
    return 0 if operation["status"] in SUCCESS else 1
