"""Pins the public surface of dispatcher.http."""

from __future__ import annotations

import inspect

import dispatcher.http

PUBLIC = {
    "Address",
    "MalformedBody",
    "BodyTooLarge",
    "ErrorPage",
    "HTTPError",
    "HTTPStream",
    "Handler",
    "Headers",
    "ServerLimits",
    "PeerGone",
    "Request",
    "RequestTimeout",
    "Responder",
    "Server",
    "ShutdownHook",
    "WebSocket",
    "WebSocketClosed",
    "serve_http",
    "serve_http_until_signal",
}


def test_public_names() -> None:
    names = {name for name in vars(dispatcher.http) if not name.startswith("_")}
    assert names == PUBLIC


def test_serve_http_signature() -> None:
    parameters = inspect.signature(dispatcher.http.serve_http).parameters
    assert list(parameters) == [
        "handler",
        "host",
        "port",
        "limits",
        "ssl_context",
        "on_shutdown",
        "on_drain",
        "error_page",
        "task_status",
    ]
    assert parameters["host"].default == "127.0.0.1"
    assert parameters["port"].default == 0
    assert parameters["limits"].default == dispatcher.http.ServerLimits()


def test_errors() -> None:
    import trio

    assert issubclass(dispatcher.http.PeerGone, trio.BrokenResourceError)
    for error in ("PeerGone", "BodyTooLarge", "WebSocketClosed", "RequestTimeout", "MalformedBody"):
        assert issubclass(getattr(dispatcher.http, error), dispatcher.http.HTTPError)
