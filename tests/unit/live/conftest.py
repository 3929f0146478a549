"""A fake OpenAI-compatible server in a background thread (the replay under test runs its own event loop)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from aiohttp import web

from kvbench.testing.fakeserver import FakeServer, fault_plan

from ...conftest import free_port  # also imported from here by the tests of this folder


class RunningServer:
    def __init__(self, server: FakeServer):
        self.server = server
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _serve(self):
        asyncio.set_event_loop(self._loop)
        runner = web.AppRunner(self.server.app(), access_log=None)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    def stop(self):
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


@pytest.fixture
def fake_server():
    """Factory: fake_server(faults=["3:cut"], itl_ms=0, block_size=16, require_key=None) -> RunningServer."""
    started = []

    def start(faults=(), itl_ms=0.0, block_size=16, require_key=None, max_model_len=None):
        fake = FakeServer(block_size, itl_ms / 1000.0, fault_plan(list(faults)), require_key=require_key,
                          max_model_len=max_model_len)  # fmt: skip
        srv = RunningServer(fake)
        started.append(srv)
        return srv

    yield start
    for s in started:
        s.stop()
