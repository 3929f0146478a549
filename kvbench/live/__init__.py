"""Live replays against serving endpoints: when each request is sent (pacing), the HTTP client, prompts made
from block ids, latency and server counters, fault injection and distributed load generation
(docs/architecture.md)."""
