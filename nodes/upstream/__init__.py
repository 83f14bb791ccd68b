"""The node's HTTP client to its providers, shared by the HTTP adapters (``ollama``,
``openai`` in :mod:`nodes.adapters`) and the tunnels (:mod:`nodes.tunnel`):

* :mod:`.client` -- the HTTP/1.1 client itself, our own over Trio streams with h11 reading
  the answers: a pool of kept-alive connections (:class:`~.client.UpstreamPool`), a response
  left so that its connection is reused (:func:`~.client.finished`);
* :mod:`.pools` -- each provider's pooled client as the config sets it: its timeouts, its size
  (its slots), opened with the shared TLS context (:func:`~.pools.open_client`);
* :mod:`.tls` -- the one TLS context per distinct TLS setting that every client shares;
* :mod:`.redact` -- the provider's address and the node's credentials removed from a message;
* :mod:`.lines` -- a streamed body split into lines and server-sent events as it arrives.

What a failure means is the caller's -- a run's :class:`~nodes.adapters.base.AdapterError`
(:mod:`nodes.adapters`), a tunnel's ``tunnel.end`` error (:mod:`nodes.tunnel`) -- and nothing
here imports either.
"""
