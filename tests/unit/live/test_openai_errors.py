"""The openai backend's words when something is wrong before or during a run: discovery refused (401/403/404),
a URL given with /v1, an API key variable that is not set, and the class each failed request's error starts
with (fake server)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from kvbench.backends.openai import OpenAIBackend

from kvbench.errors import KvbenchError
from kvbench.metrics.latency import error_class
from kvbench.redact import MASK
from kvbench.run.runner import run_replay

from ...conftest import CHAT

N = 8


def replay(url, out, **options):
    opts = {"url": url, "mode": "rate", "rate": 400.0, "max_requests": N, "timeout_s": 3.0, **options}
    return run_replay(CHAT, "openai", opts, out=out, report=False)


def statuses(run_dir):
    return set(pq.read_table(run_dir / "requests.parquet").column("status").to_pylist())


def test_model_list_refused_without_a_key_says_how_to_give_one(fake_server, tmp_path, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    srv = fake_server(require_key="K1")
    expected = (
        rf"^cannot list models: GET {srv.url}/v1/models answered http 401: .*missing API key.* "
        r"\(the server wants a key; set it with --api-key-env VAR"
    )
    with pytest.raises(KvbenchError, match=expected) as err:
        replay(srv.url, tmp_path / "r")
    assert "\n" not in str(err.value)


def test_a_wrong_key_is_named_as_refused_credentials(fake_server, tmp_path):
    srv = fake_server(require_key="K1")
    with pytest.raises(KvbenchError, match=r"answered http 403: .*invalid API key.*refused the credentials sent"):
        replay(srv.url, tmp_path / "r", headers=("X-Api-Key: nope",))


def test_a_refused_key_stops_the_run_even_when_the_model_is_given(fake_server, tmp_path, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    srv = fake_server(require_key="K1")
    with pytest.raises(KvbenchError, match=rf"^GET {srv.url}/v1/models answered http 401: .*--api-key-env VAR"):
        replay(srv.url, tmp_path / "r", served_model="fake")
    assert srv.server.received == 0  # nothing was sent


def test_a_wrong_path_in_the_url_is_a_404_that_points_at_the_url(fake_server, tmp_path):
    srv = fake_server()
    with pytest.raises(KvbenchError, match=r"/api/v1/models answered http 404: .*base.*Give --served-model NAME"):
        replay(srv.url + "/api", tmp_path / "r")


@pytest.mark.parametrize("suffix", ["/v1", "/v1/", "/"])
def test_a_url_ending_in_v1_is_the_same_server(fake_server, tmp_path, suffix):
    srv = fake_server()
    run_dir, summary = replay(srv.url + suffix, tmp_path / "r")
    assert statuses(run_dir) == {"ok"} and summary["complete"]
    assert summary["config"]["url"] == srv.url


def test_the_key_may_come_from_a_variable_a_header_or_the_url(fake_server, tmp_path, monkeypatch):
    srv = fake_server(require_key="K1")
    monkeypatch.setenv("MY_KEY", "K1")
    host = srv.url.removeprefix("http://")
    runs = [
        (srv.url, {"api_key_env": "MY_KEY"}),
        (srv.url, {"headers": ("X-Api-Key: K1",)}),
        (srv.url, {"headers": ("Authorization: Bearer K1",)}),
        (f"http://user:K1@{host}", {}),
    ]
    for i, (url, options) in enumerate(runs):
        run_dir, summary = replay(url, tmp_path / f"r{i}", **options)
        assert statuses(run_dir) == {"ok"}, options
        assert "K1" not in repr(summary["config"])


def test_an_api_key_variable_that_is_not_set_is_an_error_naming_it(monkeypatch):
    monkeypatch.delenv("KVBENCH_NO_SUCH_KEY", raising=False)
    with pytest.raises(KvbenchError, match=r"^--api-key-env KVBENCH_NO_SUCH_KEY: the variable KVBENCH_NO_SUCH_KEY"):
        OpenAIBackend(url="http://127.0.0.1:1", api_key_env="KVBENCH_NO_SUCH_KEY")


def test_the_default_key_variable_may_be_unset(fake_server, tmp_path, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    run_dir, _ = replay(fake_server().url, tmp_path / "r")
    assert statuses(run_dir) == {"ok"}


def test_config_never_holds_a_credential():
    backend = OpenAIBackend(
        url="https://alice:S3CRET@example.com:8443/v1",
        headers=("Authorization: Bearer S3CRET", "X-Api-Key: S3CRET", "X-Tenant: blue"),
    )
    config = backend.config()
    assert "S3CRET" not in repr(config) and "alice" not in repr(config)
    assert config["url"] == f"https://{MASK}@example.com:8443"
    assert config["headers"] == {"Authorization": MASK, "X-Api-Key": MASK, "X-Tenant": "blue"}
    assert backend.url == "https://example.com:8443"  # what paths are appended to: no credentials in it


@pytest.mark.parametrize("spec", ["no colon here", ": v4lue", "Two Words: x"])
def test_a_malformed_header_is_refused_without_echoing_it(spec):
    with pytest.raises(KvbenchError, match="--header must be written 'Name: value'") as err:
        OpenAIBackend(url="http://127.0.0.1:1", headers=(spec,))
    assert spec not in str(err.value)


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "ftp://host", "http://"])
def test_a_url_that_is_not_http_is_refused(url):
    with pytest.raises(KvbenchError, match="--url must look like http://HOST:PORT"):
        OpenAIBackend(url=url)


def test_error_class_is_the_text_before_the_first_colon():
    assert error_class("http 429: slow down") == "http 429"
    assert error_class("not an event stream: the server answered text/html: <html>") == "not an event stream"
    assert error_class("timeout: no complete answer within 3 s") == "timeout"
    assert error_class("worker_lost") == "worker_lost"
    assert error_class(None) is None


def test_a_model_list_that_is_a_web_page_is_quoted(tmp_path):
    """A proxy's login page instead of JSON: named, quoted, and what to do."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Page(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the http.server hook's name
            body = b"<html><title>Sign in</title></html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_port}"
        with pytest.raises(KvbenchError, match=r"answered text/html, not a model list: <html><title>Sign in"):
            replay(url, tmp_path / "r")
    finally:
        httpd.shutdown()


def test_a_refused_metrics_endpoint_is_a_warning_not_a_failure(tmp_path, capsys):
    """/metrics behind other credentials: the run is measured without server counters, and says why."""
    from aiohttp import web

    from kvbench.testing.fakeserver import FakeServer

    from .conftest import RunningServer

    class MetricsRefused(FakeServer):
        async def metrics(self, request):
            return web.json_response({"error": "forbidden"}, status=403)

    srv = RunningServer(MetricsRefused())
    try:
        run_dir, summary = replay(srv.url, tmp_path / "r")
    finally:
        srv.stop()
    assert statuses(run_dir) == {"ok"}
    assert summary["points"][0]["server_counters"] == {"available": False}
    warning = f"kvbench: warning: GET {srv.url}/metrics answered http 403: "
    assert warning in capsys.readouterr().err
