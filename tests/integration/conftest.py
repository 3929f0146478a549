"""Integration tests against real engines started by `kvbench engine up` (see .ci/start-engines)."""

import socket


def pytest_configure(config):
    # pyproject's marker list belongs to others; this one is registered here.
    config.addinivalue_line(
        "markers",
        "engine: needs a real serving engine started by `kvbench engine up` (.ci/start-engines); skipped when "
        "none runs, unless KVBENCH_REQUIRE_ENGINES is set",
    )


# A stand-in engine server (answers /health) for the tests of engine process handling, which need no engine.
FAKE_SERVER = r"""
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
print("fake server up", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
