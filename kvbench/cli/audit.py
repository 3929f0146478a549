"""`kvbench audit …`: checks of what a live server promises (cache isolation between tenants)."""

from __future__ import annotations

import dataclasses
import json

import click

from kvbench import options
from kvbench.cli.render import console


@click.group()
def audit():
    """Check properties of a live server."""


@dataclasses.dataclass(frozen=True)
class IsolationOptions:
    """The options of `isolation`."""

    url: str | None = options.option(
        None,
        "server base URL, e.g. http://127.0.0.1:8011",
        unit="URL",
        required=True,
        envvar="KVBENCH_URL",
    )
    model: str | None = options.served_model(
        "model to probe [default: the first of GET /v1/models] (a name, not a geometry)"
    )
    vocab: int = options.option(
        4096,
        "probe token ids are drawn below this (at most the model's vocabulary size)",
        unit="token ids",
        type=click.IntRange(min=64),
    )
    as_json: bool = options.option(
        False,
        "print the probes and the verdict as JSON",
        unit="on/off",
        flag="--json",
        is_flag=True,
    )


@audit.command()
@options.command_options(IsolationOptions)
def isolation(url, model, vocab, as_json):
    """Send paired probes (same prefix with same salt / other salt / no salt, and an unsalted control) and
    report whether cache_salt isolates cached prefixes. Exits 1 when salts do not isolate."""
    from kvbench.live.audit import audit_isolation

    with console.status("probing"):
        result = audit_isolation(url, model, vocab)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        for p in result["probes"]:
            mark = {True: "pass", False: "FAIL", None: "n/a"}[p["passed"]]
            seen = p["cached_tokens"] if p["cached_tokens"] is not None else p["counter_cached"]
            want = "hit" if p["expect_hit"] else "miss"
            click.echo(f"  {mark:>4}  {p['name']:<30} expect {want:<4}  cached tokens: {seen}")
        click.echo(f"{result['url']} ({result['model']}): {result['verdict']}")
    if result["passed"] is False:
        raise SystemExit(1)
