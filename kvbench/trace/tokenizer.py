"""Token ids of an OpenAI-style request body, for recording traffic (`kvbench trace record`) and importing
request logs (`kvbench trace import openai-log`): the prompt is tokenized, hashed into keyed block ids
(`kvbench.trace.keyed`) and dropped; no text is kept.

Two sources, the same answers where both exist:

- `UpstreamTokenizer`: the serving engine's own `/tokenize` endpoint (vLLM, SGLang), which renders chat
  messages with the model's chat template, so the ids are the ones the engine caches;
- `LocalTokenizer`: a `tokenizer.json` on disk (the `tokenizers` package; nothing is downloaded). With no chat
  template at hand, messages are rendered as role and content lines: the ids differ from the engine's, but
  equal conversations still give equal ids, which is what a cache trace needs.

A request body is a /v1/completions one (`prompt`: text, or token ids already) or a /v1/chat/completions one
(`messages`). Batched prompts (a list of texts) are refused: one trace row is one request.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

from kvbench.errors import KvbenchError

TIMEOUT_S = 30.0


class NotTokenizable(KvbenchError):
    """A request body whose prompt cannot be read (the message says which field, and why)."""


def prompt_of(body: dict) -> tuple[str, object]:
    """("chat", messages) or ("prompt", text or token ids) of a request body; NotTokenizable otherwise."""
    if isinstance(body.get("messages"), list):
        return "chat", body["messages"]
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return "prompt", prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return "prompt", prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        return prompt_of({"prompt": prompt[0]})
    if isinstance(prompt, list):
        raise NotTokenizable("field 'prompt': a batch of prompts; record one prompt per request")
    raise NotTokenizable("no 'messages' list and no 'prompt' text or token ids")


def tokenize_payload(body: dict) -> dict:
    """The /tokenize request for `body` (vLLM's and SGLang's shape): the model, and the prompt or the
    messages with the generation prompt the engine adds before answering."""
    kind, prompt = prompt_of(body)
    payload: dict = {"model": body["model"]} if body.get("model") else {}
    if kind == "chat":
        return {**payload, "messages": prompt, "add_generation_prompt": True}
    return {**payload, "prompt": prompt}


def token_ids(answer: dict, where: str) -> list[int]:
    """The token ids of a /tokenize answer ({"tokens": [...]})."""
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise KvbenchError(f"{where}: /tokenize answered without a 'tokens' list of ids")
    return tokens


def _text(content) -> str:
    """A message's content as text: a string, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def render_messages(messages: list) -> str:
    """Messages as one text without a chat template: a line with the role, then the content, per message,
    and the assistant's turn opened at the end (as add_generation_prompt does)."""
    parts = []
    for m in messages:
        if not isinstance(m, dict):
            raise NotTokenizable("field 'messages': an item is not an object")
        parts.append(f"<|{m.get('role', 'user')}|>\n{_text(m.get('content'))}\n")
    return "".join(parts) + "<|assistant|>\n"


class LocalTokenizer:
    """A tokenizer.json read with the `tokenizers` package."""

    def __init__(self, path: str | Path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise KvbenchError("a local tokenizer needs the tokenizers package: pip install tokenizers") from None
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # the library raises its own Exception subclass for any unreadable file
            raise KvbenchError(f"{path}: not a tokenizer.json the tokenizers package can read ({exc})") from None
        self.name = f"local:{Path(path).name}"

    def ids(self, body: dict) -> list[int]:
        kind, prompt = prompt_of(body)
        if isinstance(prompt, list) and kind == "prompt":
            return list(prompt)  # token ids already
        text = render_messages(prompt) if kind == "chat" else prompt
        return self._tok.encode(text, add_special_tokens=kind == "prompt").ids


class UpstreamTokenizer:
    """The engine's /tokenize endpoint, called synchronously (request logs are imported one line at a time;
    the recording proxy calls the same endpoint from its own event loop with `tokenize_payload`)."""

    def __init__(self, url: str, headers: dict | None = None):
        self.url = url.rstrip("/") + "/tokenize"
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.name = "upstream"

    def ids(self, body: dict) -> list[int]:
        kind, prompt = prompt_of(body)
        if isinstance(prompt, list) and kind == "prompt":
            return list(prompt)
        data = json.dumps(tokenize_payload(body)).encode()
        request = urllib.request.Request(self.url, data=data, headers=self.headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as r:
                return token_ids(json.loads(r.read()), self.url)
        except urllib.error.HTTPError as exc:
            said = exc.read()[:200]
            raise KvbenchError(f"{self.url}: HTTP {exc.code} ({said!r}); does the server offer /tokenize?") from None
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            raise KvbenchError(f"{self.url}: cannot reach the tokenizer ({exc}); is the server up?") from None
