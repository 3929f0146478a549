"""User-private KV: blocks belong to the user whose request computed them; a per-user quota (blocks) and a TTL
(seconds since last use) bound what a user keeps, GB-hours per user say what it costs, and `--delete-user U@t`
removes user U's KV at time t (a right-to-erasure request).

A deletion removes exactly the blocks U's requests computed that are cached at t: in HBM (they become
unreachable at once and stop accruing GB-hours; each keeps its slot until the policy evicts it, as a freed
block whose content is gone) and in the instance's DRAM and SSD tiers (dropped). KV computed after t is new
KV: when a request computes a deleted block again it is cached again, owned by that request's user, and hit
as any block is. The run counts hits on deleted KV (must be 0) and the hits that user's KV was still getting
before, so the proof is not vacuous; each deletion reports how many blocks it removed. Quota and TTL make
blocks unreachable the same way (and a recompute brings them back the same way)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import click
from kvbench.backends.enginesim.scenarios import Scenario, scenario

from kvbench.errors import KvbenchError
from kvbench.options import cli_options, option


def _deletions(values) -> list[tuple[str, float]]:
    out = []
    for v in values or ():
        user, _, when = str(v).rpartition("@")
        try:
            out.append((user, float(when)))
        except ValueError:
            raise KvbenchError(f"--delete-user {v!r}: write USER@SECONDS, e.g. --delete-user user-7@600") from None
        if not user:
            raise KvbenchError(f"--delete-user {v!r}: no user before '@'")
    return out


@dataclass(frozen=True)
class UserKVOptions:
    """The engine-sim options of the UserKV scenario."""

    delete_user: str | None = option(
        None,
        "USER@SECONDS: delete that user's KV at that trace time (seconds); repeatable",
        unit="name@s",
        multiple=True,
    )
    user_kv_ttl: float | None = option(
        None,
        "seconds a user's block stays reachable after its last use",
        unit="s",
        type=click.FloatRange(min=0, min_open=True),
    )
    user_kv_quota: int | None = option(
        None,
        "blocks one user may keep cached (oldest first out)",
        unit="blocks",
        type=click.IntRange(min=1),
    )


@scenario
class UserKV(Scenario):
    name = "user-kv"
    options = cli_options(UserKVOptions)

    def __init__(self, deletions, ttl, quota):
        self.deletions, self.ttl, self.quota = deletions, ttl, quota

    @classmethod
    def create(cls, settings):
        deletions = _deletions(settings.get("delete_user"))
        ttl, quota = settings.get("user_kv_ttl"), settings.get("user_kv_quota")
        if not deletions and ttl is None and quota is None:
            return None
        return cls(deletions, ttl, quota)

    def attach(self, instances, reqs, trace, prep, block_size):
        if "user_id" not in trace.column_names or trace.column("user_id").null_count == trace.num_rows:
            raise KvbenchError("the user-private KV scenario needs the trace's user_id column; this trace has none")
        self.user = trace.column("user_id").cast("string").to_pylist()
        self.owner: dict[tuple[int, int], str] = {}  # (instance, key) -> user whose request computed it
        self.last_used: dict[tuple[int, int], float] = {}
        self.gone: set[tuple[int, int]] = set()  # deleted, expired or over quota: unreachable until recomputed
        self.deleted: set[tuple[int, int]] = set()  # gone by a deletion, until computed again
        self.removed: dict[int, int] = {}  # deletion (index in self.deletions) -> blocks it removed
        self.below: dict[tuple[int, int], str] = {}  # (instance, key) evicted from HBM to a local tier -> user
        self.kept: dict[str, deque] = {}
        self.born: dict[tuple[int, int], float] = {}  # reachable block -> since when it is held
        self.byte_seconds: dict[str, float] = {}
        self.kvb = instances[0].kv_bytes_block
        self.hits_on_deleted = 0
        self.hits_before = {u: 0 for u, _ in self.deletions}
        self.instances, self.prep = instances, prep
        for inst in instances:
            self._wrap(inst)

    def _keys(self, row: int) -> list:
        p = self.prep
        return p.keys[p.offsets[row] : p.offsets[row + 1]].tolist()

    def _wrap(self, inst) -> None:
        """Unreachable blocks miss, and what a request hits and computes is followed, through the policy's public
        calls: `contains` for lookups, and begin's hit capped through max_hit (a policy may walk its prefix
        without asking `contains`, as the vLLM pool does)."""
        cache, i = inst.cache, inst.index
        contains, insert, evict, lookup, begin = cache.contains, cache.insert, cache.evict, cache.lookup, cache.begin

        def reachable(key):
            return self._reachable((i, key), inst.now) and contains(key)

        def looked_up(row):
            hit, keys = lookup(row), self._keys(row)
            return next((pos for pos in range(hit) if not self._reachable((i, keys[pos]), inst.now)), hit)

        def begun(row, **kw):
            saved = self.prep.max_hit[row]
            self.prep.max_hit[row] = min(saved, looked_up(row))
            try:
                hit = begin(row, **kw)
            finally:
                self.prep.max_hit[row] = saved
            keys = self._keys(row)
            for key in keys[:hit]:
                self._used((i, key), inst.now)
            for key in keys[hit:]:
                k = (i, key)
                # computed by this request: a block still cached but unreachable holds new KV now (a policy may
                # keep the old entry, or add a copy, without calling insert)
                if k in self.gone and contains(key):
                    self._adopt(k, self.user[row], inst.now)
            return hit

        def inserted(key):
            insert(key)
            self._adopt((i, key), self.user[cache.request], inst.now)

        def evicted(key):
            evict(key)
            k = (i, key)
            self._close(k, inst.now)
            owner = self.owner.pop(k, None)  # owners are of cached KV only: what a deletion may remove
            if owner is not None and k not in self.gone and inst.tiers.local:
                self.below[k] = owner  # written back to DRAM (or SSD below it): still the user's KV

        cache.contains, cache.lookup, cache.begin = reachable, looked_up, begun
        cache.insert, cache.evict = inserted, evicted

    def _reachable(self, k, now) -> bool:
        if k in self.gone:
            return False
        if self.ttl is not None and k in self.last_used and now - self.last_used[k] > self.ttl:
            self._drop(k, now)
            return False
        return True

    def _used(self, k, now) -> None:
        """Block k was hit at `now`."""
        if k in self.deleted:  # only a policy that ignored the capped hit could get here: the proof counts it
            self.hits_on_deleted += 1
        owner = self.owner.get(k)
        if owner in self.hits_before and not any(u == owner and t <= now for u, t in self.deletions):
            self.hits_before[owner] += 1
        self.last_used[k] = now

    def _adopt(self, k, user, now) -> None:
        self._close(k, now)
        self.gone.discard(k)
        self.deleted.discard(k)
        self.owner[k], self.last_used[k] = user, now
        self.born[k] = now
        if self.quota is not None:
            mine = self.kept.setdefault(user, deque())
            mine.append(k)
            while len(mine) > self.quota:
                old = mine.popleft()
                if self.owner.get(old) == user and old not in self.gone:
                    self._drop(old, now)

    def _drop(self, k, now) -> None:
        self.gone.add(k)
        self._close(k, now)

    def _close(self, k, now) -> None:
        born = self.born.pop(k, None)
        if born is not None and k in self.owner:
            user = self.owner[k]
            self.byte_seconds[user] = self.byte_seconds.get(user, 0.0) + (now - born) * self.kvb

    def timers(self, schedule):
        return [(t, self._deleter(n, user)) for n, (user, t) in enumerate(self.deletions)]

    def _deleter(self, n: int, user: str):
        def delete(t):
            mine = [k for k, owner in self.owner.items() if owner == user and k not in self.gone]
            for k in mine:
                self._drop(k, t)
                self.deleted.add(k)
            removed = len(mine)
            # copies below HBM: its write-through copies, and what HBM wrote back to DRAM / SSD
            for k in mine + [k for k, owner in self.below.items() if owner == user]:
                tiers = self.instances[k[0]].tiers.local
                present = [tier for tier in tiers if tier.blocks.pop(k[1], False) is None]
                removed += bool(present) and k not in self.owner
                self.below.pop(k, None)
            self.removed[n] = removed

        return delete

    def summary(self, reqs, instances, prep, kv_bytes_block):
        end = max(i.now for i in instances)
        for k in list(self.born):
            self._close(k, end)
        top = sorted(self.byte_seconds.items(), key=lambda kv: -kv[1])[:20]
        return {
            "deletions": [
                {"user": u, "at_s": t, "blocks": self.removed.get(n, 0)} for n, (u, t) in enumerate(self.deletions)
            ],
            "hits_on_deleted_kv": self.hits_on_deleted,
            "hits_before_deletion": self.hits_before,
            "ttl_s": self.ttl,
            "quota_blocks": self.quota,
            "gb_hours_by_user": {u: b / 1e9 / 3600 for u, b in top},
        }
