"""URLs a person typed with secrets in them (`relax.utils.urls`): whatever shape the text has, a well-formed URL, one
without its scheme, with a broken port or bracket, or with a token in its fragment, neither its redacted form nor
the error that refuses it shows a secret (the errors of `--rm-url` and of an engine address included)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.backends.inference.remote.sglang import HTTPClient
from relax.rollout.rewards.remote import RemoteReward
from relax.utils.urls import parse_http_url, redact_url

# Secrets long enough that finding one in a message is never chance.
SECRET = st.text(alphabet="ABCDEFGHJKMNPQRSTUVWXYZ23456789", min_size=8, max_size=12)
SHAPES = [
    "http://{user}:{secret}@{host}:8000/x",  # well formed
    "{user}:{secret}@{host}:8000/x",  # no scheme: the parser reads the user name as the scheme
    "//{user}:{secret}@{host}/x",  # no scheme, a network path
    "http:/{user}:{secret}@{host}/x",  # one slash
    "http://{user}:{secret}@{host}:99999/x",  # a port out of range
    "http://{user}:{secret}@[::1/x",  # a bracket never closed
    "https://{host}/x?token={secret}",
    "{host}:8000/x?token={secret}",
    "http://{host}/x#{secret}",  # a token in the fragment
    "ftp://{user}:{secret}@{host}/x",
    "{secret}",  # the token alone, given to the wrong flag
]


@settings(max_examples=200, deadline=None)
@given(shape=st.sampled_from(SHAPES), user=SECRET, secret=SECRET,
       host=st.sampled_from(["127.0.0.1", "example.org", "[::1]", "reward-server"]))
def test_no_secret_in_the_redacted_url_or_the_error_of_any_shape(shape, user, secret, host):
    text = shape.format(user=user, secret=secret, host=host)
    shown = [redact_url(text)]
    try:
        parse_http_url(text)
    except ValueError as error:
        shown.append(str(error))
    for build in (lambda: RemoteReward(text), lambda: HTTPClient(text, api_key=None, timeout_s=1.0)):
        try:
            build()
        except ValueError as error:
            shown.append(str(error))
    for message in shown:
        assert secret not in message and user not in message, (text, message)


@pytest.mark.parametrize(("text", "problem"), [
    ("localhost:8000", "no scheme://"), ("ftp://h/x", "(scheme ftp)"), ("http://h:0/x", "port 0"),
    ("http://h/x#top", "#fragment"), ("http:///x", "no host")])
def test_the_error_says_what_is_wrong(text, problem):
    with pytest.raises(ValueError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        parse_http_url(text)
    assert redact_url("http://u:p@h:1/x?t=abc#frag") == "http://***@h:1/x?t=***#***"
