"""Authentication: client routes take a client key, admin routes (``/v1/usage``) an admin
key, ``/metrics`` an admin key when admin keys are configured, or the metrics token, which
opens nothing else; the keys are not interchangeable. Every refusal is a 401
``authentication_error`` with ``WWW-Authenticate``."""

from __future__ import annotations

import attrs
import orjson

from dispatcher.api.app import key_id

from ._support import (
    ADMIN_KEY,
    CLIENT_KEY,
    METRICS_TOKEN,
    NODE_TOKEN,
    OTHER_CLIENT_KEY,
    Edge,
    assert_error,
    chat,
    params,
    request_bytes,
)

CHAT = "/v1/chat/completions"


@attrs.frozen
class Auth:
    method: str
    path: str
    authorization: str | None
    status: int


def with_key(key: str) -> str:
    return f"Bearer {key}"


AUTH: dict[str, Auth] = {
    "no-key": Auth("POST", CHAT, None, 401),
    "wrong-key": Auth("POST", CHAT, with_key("sk-wrong"), 401),
    "empty-authorization": Auth("POST", CHAT, "", 401),
    "scheme-only": Auth("POST", CHAT, "Bearer", 401),
    "basic-scheme": Auth("POST", CHAT, "Basic c2stY2xpZW50LWhvc3RpbGU6", 401),
    "token-scheme": Auth("POST", CHAT, f"Token {CLIENT_KEY}", 401),
    "key-without-scheme": Auth("POST", CHAT, CLIENT_KEY, 401),
    "key-with-a-suffix": Auth("POST", CHAT, with_key(CLIENT_KEY + "x"), 401),
    "key-prefix-only": Auth("POST", CHAT, with_key(CLIENT_KEY[:-1]), 401),
    "key-with-an-inner-space": Auth(
        "POST", CHAT, with_key(CLIENT_KEY[:4] + " " + CLIENT_KEY[4:]), 401
    ),
    "node-token-as-a-key": Auth("POST", CHAT, with_key(NODE_TOKEN), 401),
    "admin-key-on-a-client-route": Auth("POST", CHAT, with_key(ADMIN_KEY), 401),
    "admin-key-on-models": Auth("GET", "/v1/models", with_key(ADMIN_KEY), 401),
    "client-key-on-usage": Auth("GET", "/v1/usage", with_key(CLIENT_KEY), 401),
    "no-key-on-usage": Auth("GET", "/v1/usage", None, 401),
    "client-key-on-metrics": Auth("GET", "/metrics", with_key(CLIENT_KEY), 401),
    "no-key-on-metrics": Auth("GET", "/metrics", None, 401),
    "no-key-on-models": Auth("GET", "/v1/models", None, 401),
    "no-key-on-completions": Auth("POST", "/v1/completions", None, 401),
    "metrics-token-on-a-client-route": Auth("POST", CHAT, with_key(METRICS_TOKEN), 401),
    "metrics-token-on-models": Auth("GET", "/v1/models", with_key(METRICS_TOKEN), 401),
    "metrics-token-on-usage": Auth("GET", "/v1/usage", with_key(METRICS_TOKEN), 401),
    "metrics-token-on-status": Auth("GET", "/admin/status", with_key(METRICS_TOKEN), 401),
    "metrics-token-on-reload": Auth("POST", "/admin/reload", with_key(METRICS_TOKEN), 401),
    "metrics-token-with-a-suffix": Auth("GET", "/metrics", with_key(METRICS_TOKEN + "x"), 401),
    # Accepted:
    "client-key": Auth("POST", CHAT, with_key(CLIENT_KEY), 200),
    "second-client-key": Auth("POST", CHAT, with_key(OTHER_CLIENT_KEY), 200),
    "lowercase-scheme": Auth("POST", CHAT, f"bearer {CLIENT_KEY}", 200),
    "uppercase-scheme": Auth("POST", CHAT, f"BEARER {CLIENT_KEY}", 200),
    # A field value's surrounding whitespace is not part of it (RFC 9110 section 5.5).
    "key-with-trailing-spaces": Auth("POST", CHAT, with_key(CLIENT_KEY) + "   ", 200),
    "two-spaces-after-the-scheme": Auth("POST", CHAT, f"Bearer  {CLIENT_KEY}", 200),
    "admin-key-on-usage": Auth("GET", "/v1/usage", with_key(ADMIN_KEY), 200),
    "admin-key-on-metrics": Auth("GET", "/metrics", with_key(ADMIN_KEY), 200),
    "metrics-token-on-metrics": Auth("GET", "/metrics", with_key(METRICS_TOKEN), 200),
    "no-key-on-healthz": Auth("GET", "/healthz", None, 200),
    "no-key-on-readyz": Auth("GET", "/readyz", None, 200),
}


@params(AUTH)
async def test_auth(edge: Edge, case: Auth) -> None:
    async with edge.case():
        headers = []
        if case.authorization is not None:
            headers.append(("authorization", case.authorization))
        body = None
        if case.method == "POST":
            headers.append(("content-type", "application/json"))
            body = orjson.dumps(chat())
        response = await edge.exchange(
            request_bytes(case.method, case.path, headers, body), closes=False
        )
        if case.status == 401:
            assert_error(response, 401, error_type="authentication_error", code="invalid_api_key")
            assert response.header("www-authenticate") == "Bearer"
            assert CLIENT_KEY not in response.body.decode()
        else:
            assert response.status == 200, response.body[:300]


async def test_usage_is_attributed_to_the_key_never_named_by_it(edge: Edge) -> None:
    async with edge.case():
        response = await edge.post(CHAT, chat(), key=OTHER_CLIENT_KEY)
        own = response.header("x-dispatcher-request-id")
        usage = await edge.request("GET", "/v1/usage", [("authorization", with_key(ADMIN_KEY))])
        (row,) = [row for row in usage.json()["rows"] if row["request_id"] == own]
        assert row["attribution"] == key_id(OTHER_CLIENT_KEY.encode())
        assert OTHER_CLIENT_KEY not in usage.body.decode()
