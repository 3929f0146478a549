"""The options some eviction policies take (`--quota`, `--small-fraction`, `--priority-duration-*`): their click
parameters, and their values read and checked when the backend is built, before any replay. Every bad value,
and an option that none of the chosen policies takes, is a KvbenchError naming the option."""

from __future__ import annotations

import json
import math
from pathlib import Path

import click

from kvbench.cache import policies as _policies
from kvbench.errors import KvbenchError
from kvbench.options import PolicyOption, tagged

# the unit of each policy option, stated in --help (docs/architecture.md, Options); a policy that adds an
# option adds its unit here (tests/unit/test_options.py checks that every option states one)
UNITS = {
    "quota": "share of the capacity 0-1, or blocks",
    "small_fraction": "share of the capacity, 0-1",
    "priority_duration_requests": "requests",
    "priority_duration_s": "s (trace time)",
    "slots": "slots",
    "slot_similarity": "share of the prompt, 0-1",
    "cache_reuse": "tokens",
    "cache_ram_tokens": "tokens",
    "vocab": "token ids",
}
# options that count something: whole numbers, at least this (llama-slot's; vocab as the openai backend's --vocab)
WHOLE_AT_LEAST = {"slots": 1, "cache_reuse": 0, "cache_ram_tokens": 0, "vocab": 64}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def policy_option_params() -> list[click.Option]:
    """The options some policies take (quotas, priorities' duration, …), one per name, for any backend that
    drives the policies; `parse_policy_options` reads their values."""
    registry, opts, seen = _policies.registry(), [], set()
    for pname, pol in registry.items():
        for oname, help in pol.options.items():
            if oname not in seen:
                seen.add(oname)
                takers = frozenset(p for p, other in registry.items() if oname in other.options)
                text = f"[{pname}] {help}"
                text = tagged(text, UNITS[oname]) if oname in UNITS else text
                opts.append(PolicyOption([flag(oname), oname], default=None, help=text, policies=takers))
    return opts


def _number(name: str, text) -> float:
    """A finite number: 'nan' and 'inf' parse as floats but mean nothing as a share or a duration."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value):
        raise KvbenchError(f"{flag(name)} {text!r} must be a finite number")
    return value


def _quota_share(tenant: str, value, shown: str) -> float:
    """A tenant's quota: a share of the capacity in [0, 1] or a whole number of blocks above 1 (the rule of
    `policies.tenant_quota`, checked here so that a bad one stops the run before it starts)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise KvbenchError(f"--quota {shown}: tenant {tenant!r} has {value!r}; give a share (0..1) or blocks")
    try:
        share = float(value)
    except ValueError:
        share = math.nan
    if not math.isfinite(share) or share < 0:
        raise KvbenchError(f"--quota {shown}: tenant {tenant!r} has {value!r}; a quota is a number >= 0")
    if share > 1 and share != int(share):
        raise KvbenchError(f"--quota {shown}: tenant {tenant!r} has {value!r}; a quota above 1 is whole blocks")
    return share if isinstance(value, str) else value  # a Python int stays blocks (1 is one block, 1.0 all)


def _quota_file(path: Path) -> dict:
    import tomllib  # (here: only a quota file needs it, and it costs 4 ms of every simulator run's start-up)

    try:
        text = path.read_text()
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # TOML and JSON decode errors are ValueErrors
        raise KvbenchError(f"--quota {str(path)!r}: cannot read it ({exc})") from None
    if not isinstance(data, dict):
        raise KvbenchError(f"--quota {str(path)!r}: the file must map tenant names to quotas")
    return data


def parse_quota(value: str) -> dict[str, float]:
    """'tenant=share,…' (a share of the capacity, 0..1) or '…=blocks', or a TOML/JSON file mapping tenants to
    quotas; '*' is every tenant not listed."""
    path = Path(value)
    if path.suffix in (".toml", ".json"):
        if not path.is_file():
            raise KvbenchError(f"--quota {value!r}: no such file")
        data = _quota_file(path)
    else:
        data = {}
        for part in (p.strip() for p in value.split(",")):
            tenant, sep, share = part.rpartition("=")
            if not sep or not tenant.strip() or not share.strip():
                raise KvbenchError(
                    f"--quota {value!r}: item {part!r} is not tenant=share (0..1 of the capacity) or tenant=blocks"
                )
            if tenant.strip() in data:
                raise KvbenchError(f"--quota {value!r} gives tenant {tenant.strip()!r} twice")
            data[tenant.strip()] = share.strip()
    if not data:
        raise KvbenchError(f"--quota {value!r} names no tenant; write tenant=share,… or a TOML/JSON file")
    return {str(k): _quota_share(str(k), v, repr(value)) for k, v in data.items()}


def _parse_option(name: str, value):
    """Policy options arrive as text from the CLI (or as numbers and dicts from Python callers)."""
    if name == "quota":
        return parse_quota(value) if isinstance(value, str) else {k: _quota_share(k, v, "") for k, v in value.items()}
    number = _number(name, value)
    if name == "small_fraction" and not 0 < number <= 1:
        raise KvbenchError(f"{flag(name)} {value!r} must be a share of the capacity in (0, 1]")
    if name.startswith("priority_duration") and number < 0:
        raise KvbenchError(f"{flag(name)} {value!r} must be >= 0")
    if name == "priority_duration_requests" and number != int(number):
        raise KvbenchError(f"{flag(name)} {value!r} must be a whole number of requests")
    if name in WHOLE_AT_LEAST:
        if number != int(number) or number < WHOLE_AT_LEAST[name]:
            least = WHOLE_AT_LEAST[name]
            raise KvbenchError(f"{flag(name)} {value!r} must be a whole number >= {least} ({UNITS[name]})")
        return int(number)
    if name == "slot_similarity" and not 0 <= number <= 1:
        raise KvbenchError(f"{flag(name)} {value!r} must be a share of the prompt in [0, 1] (0 turns it off)")
    return number


def parse_policy_options(values: dict, policies: list[str] | None = None) -> dict:
    """The given options, read and checked. With `policies` (the chosen names), an option that none of them
    takes is an error: silently ignoring `--quota` under lru would report a run the user did not ask for."""
    given = {k: v for k, v in values.items() if v is not None}
    if policies is not None:
        registry = _policies.registry()
        for name in given:
            if not any(name in registry[p].options for p in policies):
                takers = ", ".join(p for p, pol in registry.items() if name in pol.options)
                chosen = ",".join(policies)
                raise KvbenchError(f"{flag(name)} is an option of {takers}; --policy {chosen} does not use it")
    parsed = {k: _parse_option(k, v) for k, v in given.items()}
    if "priority_duration_requests" in parsed and "priority_duration_s" in parsed:
        raise KvbenchError("give --priority-duration-requests or --priority-duration-s, not both")
    return parsed


def check_quota_tenants(options: dict, tenant_names: list[str]) -> None:
    """Once the trace is known (before any point runs): every tenant a quota names is one of the trace's."""
    unknown = sorted(set(options.get("quota") or {}) - set(tenant_names) - {"*"})
    if unknown:
        known = ", ".join(sorted(map(str, tenant_names))[:10]) or "none"
        raise KvbenchError(f"--quota names tenants not in the trace: {', '.join(unknown)} (the trace has: {known})")
