"""The TLS context of the node's HTTP clients to its providers: one per distinct TLS setting,
shared by every client of the process (the adapters' and the tunnels' alike). Building one
loads the CA bundle, ~50 ms of CPU: it is built once, never per request or per client."""

from __future__ import annotations

import functools
import os
import ssl

import httpx  # noqa: ASYNC127  (the project depends on httpx; see pyproject.toml)


def tls_context() -> ssl.SSLContext:
    """The TLS context for the node's HTTP clients under today's setting: httpx's default
    (``verify=True``, trusting the environment): the CA file ``SSL_CERT_FILE`` names, else
    the directory ``SSL_CERT_DIR`` names, else certifi's bundle. Built once per distinct
    setting and shared (clients never change it: :class:`~nodes.upstream.client.UpstreamPool`
    only wraps connections with it)."""
    return _tls_context(
        os.environ.get("SSL_CERT_FILE") or None, os.environ.get("SSL_CERT_DIR") or None
    )


@functools.cache
def _tls_context(cafile: str | None, capath: str | None) -> ssl.SSLContext:
    if cafile is not None:
        return ssl.create_default_context(cafile=cafile)
    if capath is not None:
        return ssl.create_default_context(capath=capath)
    return httpx.create_ssl_context(verify=True, trust_env=False)  # certifi's bundle
