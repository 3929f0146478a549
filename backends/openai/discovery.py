"""Where and how to reach an OpenAI-compatible server, and the calls made before a run: the model list, the
prefix-cache reset, a first look that the server is there at all.

`--url` may carry credentials (``http://user:key@host``): they are taken out of the URL and sent as a basic
`Authorization` header, so that no URL kvbench prints, records or puts in an exception holds them. A URL ending
in ``/v1`` is the same server as without it (the request paths add ``/v1`` themselves). A discovery call the
server refuses or does not know stops the run with one line that quotes the server and says what to do."""

from __future__ import annotations

import base64
import json
import os
from urllib.parse import unquote, urlsplit, urlunsplit

import aiohttp

from kvbench.errors import KvbenchError
from kvbench.redact import MASK, is_secret_name

from .client import BODY_SHOWN, describe_exception, one_line

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


def _refused_hint(status: int, sent_auth: bool) -> str:
    if status in (401, 403):
        if sent_auth:
            return "the server refused the credentials sent; check the key given by --api-key-env, --header or the URL"
        return "the server wants a key; set it with --api-key-env VAR or --header 'Authorization: Bearer …'"
    if status == 404:
        return "is --url the server's base address, http://HOST:PORT without an API path?"
    return "check the server's log"


async def _answer(resp: aiohttp.ClientResponse) -> str:
    return (await resp.text(errors="replace"))[:BODY_SHOWN]


async def _refused(where: str, resp: aiohttp.ClientResponse, sent_auth: bool, prefix: str = "", more: str = ""):
    """One line for a discovery call the server did not answer with 200: its status, its words, what to do."""
    hint = _refused_hint(resp.status, sent_auth) + more  # kvbench's own words: not passed through redaction
    return KvbenchError(f"{prefix}{where} answered http {resp.status}: {one_line(await _answer(resp))} ({hint})")


async def first_model(session: aiohttp.ClientSession, address: ServerAddress, sent_auth: bool) -> str:
    """The first model of GET /v1/models (what a run asks for when --model is not given)."""
    where = f"GET {address.shown()}/v1/models"
    try:
        async with session.get(address.base + "/v1/models") as resp:
            if resp.status != 200:
                more = " Give --model NAME if the server has no /v1/models" if resp.status == 404 else ""
                raise await _refused(where, resp, sent_auth, "cannot list models: ", more)
            text = await resp.text(errors="replace")
    except aiohttp.ClientError as exc:
        raise KvbenchError(
            f"cannot list models: {where}: {describe_exception(exc)} (is the server up? "
            "`kvbench engine status` lists local engines)"
        ) from None
    except TimeoutError:
        raise KvbenchError(f"cannot list models: {where}: timeout: no answer (is the server up?)") from None
    try:
        models = json.loads(text).get("data")  # read whatever the content type says (some servers say text/plain)
    except (ValueError, AttributeError):
        models = None
    if not models or not isinstance(models, list) or not isinstance(models[0], dict) or "id" not in models[0]:
        raise KvbenchError(
            f"cannot list models: {where} answered {resp.content_type}, not a model list: "
            f"{one_line(text[:BODY_SHOWN])} (give --model NAME)"
        )
    return models[0]["id"]


async def check_reachable(session: aiohttp.ClientSession, address: ServerAddress, sent_auth: bool) -> None:
    """With --model given, GET /v1/models only to learn before sending anything that the server is there and
    takes the credentials (a server without a model list is fine)."""
    where = f"GET {address.shown()}/v1/models"
    try:
        async with session.get(address.base + "/v1/models") as resp:
            if resp.status in (401, 403):
                raise await _refused(where, resp, sent_auth)
    except aiohttp.ClientConnectorError as exc:
        raise KvbenchError(
            f"cannot reach the server: {where}: {describe_exception(exc)} (is the server up? "
            "`kvbench engine status` lists local engines)"
        ) from None
    except (aiohttp.ClientError, TimeoutError):
        pass  # it answered something: the requests themselves will say what is wrong


async def reset_prefix_cache(session: aiohttp.ClientSession, address: ServerAddress, sent_auth: bool) -> None:
    answers = []
    for path in ("/reset_prefix_cache", "/flush_cache"):  # vLLM, SGLang
        async with session.post(address.base + path) as resp:
            if resp.status == 200:
                return
            if resp.status in (401, 403):
                raise await _refused(f"POST {address.shown()}{path}", resp, sent_auth)
            answers.append(f"{path}: http {resp.status}")
    raise KvbenchError(
        f"{address.shown()} has no /reset_prefix_cache or /flush_cache ({', '.join(answers)}); start vLLM with "
        "VLLM_SERVER_DEV_MODE=1, or drop --reset-prefix-cache"
    )
