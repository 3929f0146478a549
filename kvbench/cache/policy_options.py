"""The options some eviction policies take (`--quota`, `--small-fraction`, `--priority-duration-*`): their click
parameters, and their values read and checked when the backend is built, before any replay. Every bad value,
and an option that none of the chosen policies takes, is a KvbenchError naming the option."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import click

from kvbench.cache import policies as _policies
from kvbench.errors import KvbenchError
from kvbench.options import PolicyOption, cli_option, spec


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _declared() -> dict[str, tuple[dataclasses.Field, frozenset[str], str]]:
    """Each policy option by name: its field (help, unit, bounds), the policies that take it, and the first."""
    out: dict = {}
    for pname, pol in _policies.registry().items():
        for f in _policies.option_fields(pol):
            field, takers, first = out.get(f.name, (f, frozenset(), pname))
            out[f.name] = (field, takers | {pname}, first)
    return out


def policy_option_params() -> list[click.Option]:
    """The options some policies take (quotas, priorities' duration, …), one per name, for any backend that
    drives the policies; `parse_policy_options` reads and checks their values (click takes them as text)."""
    return [
        cli_option(f, PolicyOption, prefix=f"[{first}] ", policies=takers)
        for f, takers, first in _declared().values()
    ]


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


def _parse_option(name: str, value, field: dataclasses.Field):
    """Policy options arrive as text from the CLI (or as numbers and dicts from Python callers); a number is
    checked against its field's bounds, and a count (`whole`) is read as an int."""
    if name == "quota":  # the one option that is a mapping (tenant -> quota), not a number
        return parse_quota(value) if isinstance(value, str) else {k: _quota_share(k, v, "") for k, v in value.items()}
    number = _number(name, value)
    declared = spec(field)
    bounds = declared.bounds
    broken = bounds.broken(number) if bounds is not None else None
    if broken:
        raise KvbenchError(f"{flag(name)} {value!r} must be {broken} ({declared.unit})")
    return int(number) if bounds is not None and bounds.whole else number


def parse_policy_options(values: dict, policies: list[str] | None = None) -> dict:
    """The given options, read and checked. With `policies` (the chosen names), an option that none of them
    takes is an error: silently ignoring `--quota` under lru would report a run the user did not ask for."""
    given = {k: v for k, v in values.items() if v is not None}
    declared = _declared()
    unknown = sorted(set(given) - set(declared))
    if unknown:
        raise KvbenchError(f"no policy takes the option(s) {', '.join(map(flag, unknown))}")
    if policies is not None:
        for name in given:
            if not declared[name][1] & set(policies):
                takers = ", ".join(sorted(declared[name][1]))
                chosen = ",".join(policies)
                raise KvbenchError(f"{flag(name)} is an option of {takers}; --policy {chosen} does not use it")
    parsed = {k: _parse_option(k, v, declared[k][0]) for k, v in given.items()}
    if "priority_duration_requests" in parsed and "priority_duration_s" in parsed:
        raise KvbenchError("give --priority-duration-requests or --priority-duration-s, not both")
    return parsed


def check_quota_tenants(options: dict, tenant_names: list[str]) -> None:
    """Once the trace is known (before any point runs): every tenant a quota names is one of the trace's."""
    unknown = sorted(set(options.get("quota") or {}) - set(tenant_names) - {"*"})
    if unknown:
        known = ", ".join(sorted(map(str, tenant_names))[:10]) or "none"
        raise KvbenchError(f"--quota names tenants not in the trace: {', '.join(unknown)} (the trace has: {known})")
