"""Secrets never leave the process: what a run writes (summary.json, reports, logs, terminal lines) passes
through here first. Three kinds are masked: credentials in a URL's user-info (``http://user:key@host``), values
of query parameters, headers, options and mapping keys named like a secret (key, token, secret, password,
authorization, credential, cookie), and bearer tokens inside free text. A variable's *name* (``--api-key-env
OPENAI_API_KEY``) is not a secret and is kept; the option that names it is recognised by its ``-env`` suffix."""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

MASK = "***"

# a name is split into words at -, _, . and spaces; its last word says what it holds: "client_secret" and
# "x-api-key" hold secrets, "cached_tokens" and "s_per_token" hold numbers, so "token" and "key" count only
# after a word that makes them credentials ("access_token", "api_key") or alone
_SECRET_WORDS = {"apikey", "secret", "password", "passwd", "authorization", "credential", "credentials", "cookie"}
_OWNERS = {
    "token": {"access", "auth", "api", "bearer", "refresh", "session", "hf", "github", "gh", "secret", "id", "x"},
    "key": {"api", "access", "secret", "private", "auth", "subscription", "x"},
}
# user:password@ in any URL inside a text
_URL_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<userinfo>[^/@\s]+)@")
_BEARER = re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]{4,}")
# NAME: value or NAME=value (a header line, an env assignment, a query string); masked when NAME is a secret's
_NAMED_VALUE = re.compile(
    r"(?P<name>[A-Za-z][A-Za-z0-9_.-]*)(?P<sep>\s*[:=]\s*)(?P<value>\"[^\"]*\"|'[^']*'|[^\s&,;\"']+)"
)


def is_secret_name(name: str) -> bool:
    """A header, option, parameter or key whose value is a secret (an ``…-env`` option holds only a name)."""
    words = [w for w in re.split(r"[-_. ]+", name.strip().lstrip("-").lower()) if w]
    if not words or words[-1] == "env":
        return False
    last = words[-1]
    if last in _OWNERS:
        return len(words) == 1 or words[-2] in _OWNERS[last]
    return last in _SECRET_WORDS


def redact_url(url: str) -> str:
    """`url` without the password of its user-info and with secret-named query values masked."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return redact_text(url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{MASK}@{netloc.rsplit('@', 1)[1]}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, MASK if is_secret_name(k) else v) for k, v in pairs], safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_text(text: str) -> str:
    """Free text (an error message, a log line, a command) with every secret this module recognises masked."""
    text = _URL_USERINFO.sub(lambda m: f"{m['scheme']}{MASK}@", text)
    text = _BEARER.sub(lambda m: f"{m.group(1)} {MASK}", text)

    def named(m: re.Match) -> str:
        return f"{m['name']}{m['sep']}{MASK}" if is_secret_name(m["name"]) else m.group(0)

    return _NAMED_VALUE.sub(named, text)


def redact_argv(argv: list[str]) -> list[str]:
    """A command line with the values of secret-named options (``--api-key K``, ``--header 'Authorization: …'``,
    ``--token=K``) and URL credentials masked."""
    out: list[str] = []
    mask_next = False
    for arg in argv:
        if mask_next:
            out.append(MASK)
            mask_next = False
            continue
        if arg.startswith("--") and "=" in arg:
            name, value = arg.split("=", 1)
            out.append(f"{name}={MASK}" if is_secret_name(name) else f"{name}={redact_text(value)}")
            continue
        if arg.startswith("--") and is_secret_name(arg):
            mask_next = True
        out.append(redact_text(arg))
    return out


def redact(value):
    """`value` (JSON-like: dicts, lists, strings, numbers) with secrets masked: values under secret-named keys,
    URL credentials and secret-looking text in every string."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {k: (MASK if isinstance(k, str) and is_secret_name(k) and v else redact(v)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v) for v in value)
    return value
