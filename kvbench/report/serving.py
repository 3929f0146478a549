"""The serving sections of a run report that come from summary.json alone: the server's own counters beside
what the responses reported (live runs), and the engine model's facts (engine-sim) as a table of named facts
with units, one column per point, so points are read side by side instead of as a key dump per point."""

from __future__ import annotations

import json

from kvbench.report.page import Section, Table, pct
from kvbench.report.sections import section_at
from kvbench.report.style import duration, plain, size

# engine-sim's top-level facts, in the order a reader wants them: what was modeled, then what it cost. Keys
# not named here (a fact added later) still show, after these, under their own key.
ENGINE_FACTS = {
    "instances": "instances",
    "pool_blocks_per_instance": "HBM pool per instance (blocks)",
    "requests_per_instance": "requests per instance",
    "iterations": "engine iterations (all instances)",
    "rejected": "requests rejected",
    "preemptions": "preemptions",
    "recomputed_tokens": "tokens recomputed after preemption",
    "swap_bytes": "KV swapped out on preemption",
    "queue_s.mean": "queue wait, mean",
    "queue_s.p99": "queue wait, p99",
    "hit_blocks.local": "blocks hit in the instance's own tiers",
    "hit_blocks.global": "blocks hit in the global store",
}
LIFETIME_WORDS = {"evicted_s": "KV lifetime of evicted blocks", "all_s": "KV lifetime of all blocks"}


def value_text(key: str, value) -> str:
    """A fact's value in the unit its key names (engine-sim and its scenarios spell units in key names:
    `_bytes`, `_s`, `_gbps`, `rate`, `share`), never in scientific notation."""
    words = key.replace(".", "_").split("_")
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, str):
        return value
    if isinstance(value, list | tuple):
        # a list of numbers is one value per instance (or per adapter…): shown whole, in order
        return ", ".join(value_text(key, v) for v in value)
    if not isinstance(value, int | float):
        return str(value)
    if "bytes" in words:
        return size(value)
    if "gbps" in words:
        return f"{plain(value, 3)} GB/s"
    if {"rate", "share", "fraction"} & set(words):
        return pct(value)
    if "s" in words:
        return "0 s" if value == 0 else duration(value)
    return plain(value)


def _facts(d: dict, prefix: str = "") -> dict[str, object]:
    """A nested dict as {dotted key: value}, leaving out lists of records (they are tables of their own)."""
    out: dict[str, object] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_facts(v, key + "."))
        elif not (isinstance(v, list) and v and isinstance(v[0], dict)):
            out[key] = v
    return out


def _label(key: str) -> str:
    """A fact's row label: its name from ENGINE_FACTS, the tier traffic and lifetimes in words, else the key."""
    if key in ENGINE_FACTS:
        return ENGINE_FACTS[key]
    parts = key.split(".")
    if parts[0] == "tier_bytes" and len(parts) == 3:
        tier = "the global store" if parts[2] == "global" else parts[2].upper()
        return f"KV {parts[1]} {'from' if parts[1] == 'loaded' else 'to'} {tier}"
    if parts[0] == "kv_lifetime_s":
        if len(parts) == 3:
            return f"{LIFETIME_WORDS.get(parts[1], parts[1])}, {parts[2]}"
        return {"evicted": "blocks evicted from HBM", "still_cached": "blocks still in HBM at the end"}.get(
            parts[1], key
        )
    if parts[0] == "global_store":
        return "global store: " + words(".".join(parts[1:]))
    return words(key)


def words(key: str) -> str:
    """A key in words, its unit left to the value (written in it: not said twice): 'kv_bytes_transferred' ->
    'KV transferred', 'link_gbps' -> 'link bandwidth', 'cold_start_s' -> 'cold start'; dots become ': '."""
    swap = {"bytes": None, "s": None, "gbps": "bandwidth", "kv": "KV", "ttft": "TTFT", "tpot": "TPOT"}
    parts = []
    for part in key.split("."):
        ws = [w for w in (swap.get(w, w) for w in part.split("_")) if w]
        ws = [w for i, w in enumerate(ws) if i == 0 or w != ws[i - 1]]  # bandwidth_gbps: one 'bandwidth'
        parts.append(" ".join(ws) or part)
    return ": ".join(parts)


def _unit_key(key: str) -> str:
    """The key whose words say a fact's unit: kv_lifetime_s.evicted (a count) is not in seconds."""
    if key.startswith("kv_lifetime_s.") and key.count(".") == 1:
        return "blocks"
    if key.startswith("tier_bytes."):
        return "bytes"
    return key


def facts_table(per_point: dict[str, dict]) -> Table:
    """One row per fact (every fact any point has), one column per point."""
    flat = {name: _facts(d) for name, d in per_point.items()}
    keys: list[str] = [k for k in ENGINE_FACTS if any(k in f for f in flat.values())]
    for f in flat.values():
        keys += [k for k in f if k not in keys]
    rows = [[_label(k)] + [value_text(_unit_key(k), f[k]) if k in f else "–" for f in flat.values()] for k in keys]
    return Table(["fact", *per_point], rows)


@section_at(130, "summary", per_point=True)
def engine_section(summary: dict) -> Section:
    """A modeling backend's facts (engine-sim: preemptions, tier traffic, KV lifetimes) and each scenario's,
    for every point."""
    points = [p for p in summary.get("points", []) if p.get("engine")]
    if not points:
        return Section("Engine model")
    # no global store anywhere: one line below says so instead of a row of dashes
    skip = {"scenarios"} | ({"global_store"} if all(p["engine"].get("global_store") is None for p in points) else set())
    engines = {p["name"]: {k: v for k, v in p["engine"].items() if k not in skip} for p in points}
    items: list = [facts_table(engines)]
    if "global_store" in skip:
        items.append("No global store (--global-pool): every hit is in an instance's own tiers.")
    scenarios = sorted({s for p in points for s in (p["engine"].get("scenarios") or {})})
    for name in scenarios:
        per_point = {p["name"]: (p["engine"].get("scenarios") or {}).get(name) or {} for p in points}
        items += [f"Scenario {name}:", facts_table(per_point)]
        # a scenario's lists of records (autoscale's instances), once for the points where they are the same
        tables: dict[str, tuple[list[str], list]] = {}
        for point, scenario in per_point.items():
            for key, records in scenario.items():
                if isinstance(records, list) and records and isinstance(records[0], dict):
                    same = tables.get(json.dumps([key, records], sort_keys=True, default=str))
                    if same:
                        same[0].append(point)
                    else:
                        tables[json.dumps([key, records], sort_keys=True, default=str)] = ([point], [key, records])
        for points_with, (key, records) in tables.values():
            whose = "every point" if len(points_with) == len(per_point) else ", ".join(points_with)
            items.append(f"{name}: {words(key)} ({whose})")
            rows = [[value_text(k, v) for k, v in r.items()] for r in records]
            items.append(Table([words(k) for k in records[0]], rows))
    return Section("Engine model", items)


@section_at(120, "summary", per_point=True)
def server_section(summary: dict) -> Section:
    """The engine's /metrics counter deltas over the run beside the sums of what each response reported, for
    every live point that could read them. Both columns are counts: one number format for both."""
    rows = []
    points = [p for p in summary.get("points", []) if (p.get("server_counters") or {}).get("available")]
    for p in points:
        for key, c in sorted(p["server_counters"].get("checks", {}).items()):
            rows.append([p["name"], key, plain(c["requests"]), plain(c["server"]), "yes" if c["agree"] else "NO"])
    if not points:
        return Section("Server counters")
    note = (
        "Deltas of the engine's /metrics counters over the run beside the sums of what each response reported; "
        "they are reported separately and flagged when they differ by more than 1 %."
    )
    disagree = [p for p in points if not all(c["agree"] for c in p["server_counters"].get("checks", {}).values())]
    unanswered = sum(((p.get("failures") or {}).get("failed") or 0) for p in disagree)
    if disagree:  # say why a NO is expected, or that it is not
        note += (
            f" Here {unanswered:,} requests failed or were cut: the server counted their prompts, but no answer "
            "reported them, so the sums fall short of the deltas by about those prompts."
            if unanswered
            else " No request failed, so a NO means the server counted traffic kvbench did not send (another "
            "client on the same server during the run) or reported usage that its counters do not match."
        )
    header = ["point", "counter", "sum over responses", "server delta", "agree"]
    if len(points) == 1:  # one point: its name adds nothing to every row
        header, rows = header[1:], [r[1:] for r in rows]
    return Section("Server counters", [note, Table(header, rows)])
