"""The calls made before a run: the model list, the prefix-cache reset, a first look that the server is there at
all. A discovery call the server refuses or does not know stops the run with one line that quotes the server and
says what to do. (Where the server is and which credentials go with it: `address`.)"""

from __future__ import annotations

import json

import aiohttp
from kvbench.backends.openai.address import ServerAddress

from kvbench.errors import KvbenchError
from kvbench.live.client import BODY_SHOWN, describe_exception, one_line


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
    """The first model of GET /v1/models (what a run asks for when --served-model is not given)."""
    where = f"GET {address.shown()}/v1/models"
    try:
        async with session.get(address.base + "/v1/models") as resp:
            if resp.status != 200:
                more = " Give --served-model NAME if the server has no /v1/models" if resp.status == 404 else ""
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
            f"{one_line(text[:BODY_SHOWN])} (give --served-model NAME)"
        )
    return models[0]["id"]


async def check_reachable(session: aiohttp.ClientSession, address: ServerAddress, sent_auth: bool) -> None:
    """With --served-model given, GET /v1/models only to learn before sending anything that the server is there and
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
