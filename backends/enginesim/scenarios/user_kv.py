"""User-private KV: blocks belong to the user whose request computed them; a per-user quota (blocks) and a TTL
(seconds since last use) bound what a user keeps, GB-hours per user say what it costs, and `--delete-user U@t`
removes user U's KV at time t (a right-to-erasure request). From then on no request hits that KV: a deleted
block is unreachable until some request computes it again; the run counts hits on deleted KV (must be 0) and
the hits that user's KV was still getting before, so the proof is not vacuous."""

from __future__ import annotations

from collections import deque

import click

from kvbench.errors import KvbenchError

from . import Scenario, scenario


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


@scenario
class UserKV(Scenario):
    name = "user-kv"
    options = [
        click.Option(
            ["--delete-user"],
            multiple=True,
            help="USER@SECONDS: delete that user's KV at that trace time (seconds); repeatable",
            default=None,
        ),
        click.Option(
            ["--user-kv-ttl"],
            type=click.FloatRange(min=0, min_open=True),
            help="seconds a user's block stays reachable after its last use",
            default=None,
        ),
        click.Option(
            ["--user-kv-quota"],
            type=click.IntRange(min=1),
            help="blocks one user may keep cached (oldest first out)",
            default=None,
        ),
    ]

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
        self.gone: set[tuple[int, int]] = set()  # deleted, expired or over quota: unreachable
        self.deleted: set[tuple[int, int]] = set()  # gone by a deletion, until computed again
        self.kept: dict[str, deque] = {}
        self.born: dict[tuple[int, int], float] = {}  # reachable block -> since when it is held
        self.byte_seconds: dict[str, float] = {}
        self.kvb = instances[0].kv_bytes_block
        self.hits_on_deleted = 0
        self.hits_before = {u: 0 for u, _ in self.deletions}
        for inst in instances:
            self._wrap(inst)

    def _wrap(self, inst) -> None:
        cache, i = inst.cache, inst.index
        contains, insert, evict, on_hit = cache.contains, cache.insert, cache.evict, cache.on_hit

        def reachable(key):
            k = (i, key)
            if k in self.gone:
                return False
            if self.ttl is not None and k in self.last_used and inst.now - self.last_used[k] > self.ttl:
                self._drop(k, inst.now)
                return False
            return contains(key)

        def inserted(key):
            insert(key)
            self._adopt((i, key), self.user[cache.request], inst.now)

        def evicted(key):
            evict(key)
            self._close((i, key), inst.now)

        def hit(key, pos):
            k = (i, key)
            if k in self.deleted:
                self.hits_on_deleted += 1
            owner = self.owner.get(k)
            if owner in self.hits_before and not any(u == owner and t <= inst.now for u, t in self.deletions):
                self.hits_before[owner] += 1
            self.last_used[k] = inst.now
            on_hit(key, pos)

        cache.contains, cache.insert, cache.evict, cache.on_hit = reachable, inserted, evicted, hit

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

    def timers(self):
        return [(t, self._deleter(user)) for user, t in self.deletions]

    def _deleter(self, user):
        def delete(t):
            for k, owner in self.owner.items():
                if owner == user and k not in self.gone:
                    self._drop(k, t)
                    self.deleted.add(k)

        return delete

    def summary(self, reqs, instances, prep, kv_bytes_block):
        end = max(i.now for i in instances)
        for k in list(self.born):
            self._close(k, end)
        top = sorted(self.byte_seconds.items(), key=lambda kv: -kv[1])[:20]
        return {
            "deletions": [{"user": u, "at_s": t} for u, t in self.deletions],
            "hits_on_deleted_kv": self.hits_on_deleted,
            "hits_before_deletion": self.hits_before,
            "ttl_s": self.ttl,
            "quota_blocks": self.quota,
            "gb_hours_by_user": {u: b / 1e9 / 3600 for u, b in top},
        }
