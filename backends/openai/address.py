"""Where and how to reach an OpenAI-compatible server, read from the options alone (no network, no aiohttp, so the
backend loads without the `live` extra): the base address, the credentials and the headers.

`--url` may carry credentials (``http://user:key@host``): they are taken out of the URL and sent as a basic
`Authorization` header, so that no URL kvbench prints, records or puts in an exception holds them. A URL ending
in ``/v1`` is the same server as without it (the request paths add ``/v1`` themselves)."""

from __future__ import annotations

import base64
import os
from urllib.parse import unquote, urlsplit, urlunsplit

from kvbench.errors import KvbenchError
from kvbench.redact import MASK, is_secret_name

DEFAULT_KEY_ENV = "OPENAI_API_KEY"  # may be unset (a server without a key); any other named variable must be set


class ServerAddress:
    """A --url split into the base the paths are appended to, and the basic-auth header its user-info asks for."""

    def __init__(self, url: str):
        try:
            parts = urlsplit(url.strip())
            port = parts.port
        except ValueError:
            parts, port = None, None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise KvbenchError(
                "--url must look like http://HOST:PORT (the server's address, e.g. http://127.0.0.1:8011)"
            )
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        netloc = host if port is None else f"{host}:{port}"
        path = parts.path.rstrip("/")
        path = path.removesuffix("/v1")  # `--url http://host/v1` is common (the OpenAI SDK's base_url)
        self.base = urlunsplit((parts.scheme, netloc, path, "", ""))
        self.has_credentials = parts.username is not None
        self.auth_headers = {}
        if self.has_credentials:
            pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            self.auth_headers["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()

    def shown(self) -> str:
        """The URL as it may be printed and recorded: credentials masked, never dropped silently."""
        if not self.has_credentials:
            return self.base
        scheme, rest = self.base.split("://", 1)
        return f"{scheme}://{MASK}@{rest}"


def parse_headers(specs) -> dict[str, str]:
    """`--header 'Name: value'` options -> {Name: value}; a malformed one is refused without echoing it (it
    may be a secret)."""
    headers = {}
    for spec in specs or ():
        name, sep, value = spec.partition(":")
        name = name.strip()
        if not sep or not name or any(c.isspace() for c in name):
            raise KvbenchError("--header must be written 'Name: value', e.g. --header 'X-Api-Key: …'")
        headers[name] = value.strip()
    return headers


def shown_headers(headers: dict[str, str]) -> dict[str, str]:
    """Headers as they may be recorded: secret-named ones (Authorization, X-Api-Key, …) masked."""
    return {name: MASK if is_secret_name(name) else value for name, value in headers.items()}


def api_key(env_name: str | None) -> str | None:
    """The key in variable `env_name`. The default variable may be unset (no key is sent); one the user named
    with --api-key-env must hold a key, or the run would go out unauthenticated without a word."""
    name = env_name or DEFAULT_KEY_ENV
    key = os.environ.get(name) or None
    if key is None and name != DEFAULT_KEY_ENV:
        raise KvbenchError(f"--api-key-env {name}: the variable {name} is not set (or empty); export {name}=KEY")
    return key
