"""Rewards out of process: a reward server, a robust client, and a VLM judge over an OpenAI-compatible API.

* ``flowalign.remote.server``: ``flowalign serve-reward CONFIG`` serves registered rewards over HTTP (aiohttp), with
  request batching, a concurrency limit, health and metadata endpoints, an optional bearer token and graceful
  shutdown.
* ``flowalign.remote.client``: the ``remote`` reward, scoring through such a server (timeout, retries with backoff, a
  circuit breaker; NaN, an invalid sample, for a request that still fails), and the opt-in flow_grpo protocol.
* ``flowalign.remote.judge``: the ``vlm_judge`` reward, a vision-language model asked for a score over
  chat completions.
* ``flowalign.remote.pairwise_judge``: the ``vlm`` pairwise judge of the ``pairwise_preference`` reward (Pref-GRPO),
  a vision-language model asked which of two images is better over chat completions.
* ``flowalign.remote.wire`` the wire format (JSON with safetensors or PNG payloads; never pickle), and
  ``flowalign.remote.transport`` the client's HTTP, retries and circuit breaker (standard library only).

This package sits in the rewards layer: it imports ``flowalign.rewards`` and the foundation, never the components,
inference, training or the CLI (``tests/test_layering.py``).
"""
