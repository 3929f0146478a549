"""One serving instance as vLLM's V1 scheduler runs it: continuous batching of at most `max_num_seqs`
sequences and `max_num_batched_tokens` tokens per iteration, chunked prefill, a KV pool of blocks held while
a request runs and grown block by block as it decodes, preemption when the pool runs out, and an iteration
time from the roofline latency model.

The prefix cache is a `sim` policy's reference class (the same keys, salts and LoRA folding, the same update
rule), begun when a request is scheduled and ended when it finishes or is preempted, so requests that overlap
in time hold their blocks. Approximations, each chosen to keep the prefix cache identical to `sim` when
nothing else interferes: a request's blocks enter the cache when it is scheduled (vLLM caches a block once it
is computed); the cache may keep up to the whole pool in prefix blocks while the running sequences'
partial and decode blocks are accounted in admission and preemption only.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvbench.cache.policies.vllm import VllmPool

MAX_FAST_FORWARD = 256  # decode iterations run as one at most (bounds how late a closed-loop arrival is seen)


# eq=False: requests are compared by identity (list.remove on `running` would otherwise compare every field)
@dataclass(slots=True, eq=False)
class Req:
    row: int
    arrival: float
    n_in: int
    n_out: int
    keys: list
    max_hit: int
    start: float = -1.0  # first scheduled
    first_token: float = -1.0
    finish: float = -1.0
    hit: dict = None  # tier name -> blocks served from it (first admission)
    todo: int = 0  # prompt (and, after a recompute, generated) tokens still to prefill
    context: int = 0  # tokens whose KV the sequence holds
    generated: int = 0
    recomputed: int = 0  # tokens computed again after preemptions
    swapped: bool = False  # preempted by swapping: its KV waits on the host
    instance: int = -1
    cached_on: int = -1  # the instance whose prefix cache holds this request's blocks while it runs
    handoff: bool = False  # disaggregated: prefilled elsewhere, its KV moved here to decode
    scheduled: float = -1.0  # trace time when a client concurrency limit held it back (its send is `arrival`)
    rejected_for: str = ""  # why the pool could never hold it: its prompt, or the output it grew to
    grow_at: int = 0  # KV length from which the slot pool's `grow` has work for it again (Instance._take)


@dataclass
class Scheduler:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    preemption: str = "recompute"  # recompute | swap | protect-after
    protect_after: int = 0  # protect-after: requests past this many generated tokens are swapped, never recomputed


class Instance:
    def __init__(self, index, cache, tiers, latency, pool_blocks: int, block_size: int, sched: Scheduler, pcie_bw):
        self.index, self.cache, self.tiers, self.latency = index, cache, tiers, latency
        self.pool, self.bs, self.sched, self.pcie_bw = pool_blocks, block_size, sched, pcie_bw
        self.kv_bytes_block = latency.kv_bytes_per_token * block_size
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.used = 0  # pool blocks held by running sequences
        self.busy = False
        self.routed = 0  # requests the router sent here
        self.queued_tokens = 0  # prompt tokens of the waiting requests (kept, not summed per routing decision)
        self.scenarios: list = []
        self.slots = hasattr(cache, "grow")  # the cache is vLLM's slot pool: it decides what fits
        self.role = "both"  # or "prefill" / "decode" when disaggregated
        self.handed: list[Req] = []  # prefilled in the last step, to move to a decode instance
        self.now = 0.0  # simulated time of the work being planned or applied (for hooks that need it)
        self.born: dict[int, float] = {}  # cached block -> when HBM admitted it
        self.lifetimes: list[float] = []  # seconds each evicted block stayed in HBM
        self.window = None  # (token, start, seconds per iteration, iterations, pieces, decoding) in flight
        self.rejected: list[Req] = []  # requests larger than the whole pool: they could never run
        self.rejected_seen = 0  # (how many of them the client's in-flight count has given back)
        self._run_load = None  # tokens the running sequences still have to do; None: to be summed again
        self._pool = None  # whether grows may be skipped (vLLM's own pool, unpatched: _check_pool)
        self.stats = {"preemptions": 0, "recomputed_tokens": 0, "swap_bytes": 0, "load_bytes": {}, "steps": 0}

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.bs)

    def enqueue(self, req: Req, front: bool = False) -> None:
        (self.waiting.appendleft if front else self.waiting.append)(req)
        self.queued_tokens += req.n_in

    def dequeue(self) -> Req:
        req = self.waiting.popleft()
        self.queued_tokens -= req.n_in
        return req

    @property
    def load(self) -> int:
        """Tokens queued or in flight: what least-loaded routing balances. The running part is summed once per
        iteration, not per routing decision (plan and finish_step, which change it, drop the sum)."""
        if self._run_load is None:
            self._run_load = sum([r.todo + r.n_out - r.generated for r in self.running])  # (a list sums faster)
        return self._run_load + self.queued_tokens

    # --- admission ----------------------------------------------------------------------------------------
    def _admit(self, req: Req, now: float) -> float:
        """Look the request up and take its blocks; returns the seconds its lower-tier loads take."""
        load_s = 0.0
        if req.handoff and not req.swapped:  # prefilled on a prefill instance: decode only (KV already here)
            req.todo = 0
            self.running.append(req)
            self.used += self.blocks_for(req.context)
            return 0.0
        if req.swapped:  # its KV comes back from the host as it was
            load_s = self.latency.transfer_s(self.blocks_for(req.context) * self.kv_bytes_block, self.pcie_bw)
            self.stats["swap_bytes"] += self.blocks_for(req.context) * self.kv_bytes_block
            if req.cached_on == self.index:
                self._begin(req)
            req.swapped = False
        else:
            # the tiers below are searched before the admission writes (through) or evicts anything into them,
            # as an engine looks up its offload store before it allocates: a request never finds below HBM
            # blocks it put there itself
            found = self.tiers.find(req.keys, self.cache.lookup(req.row), req.max_hit) if self.tiers.lower else []
            hit = self._begin(req)
            req.cached_on = self.index
            for sc in self.scenarios:
                sc.admitted(self, req)
            for tier in {t.name: t for t in found}.values():
                n = sum(1 for t in found if t is tier)
                load_s += self.latency.transfer_s(n * self.kv_bytes_block, tier.bandwidth)
                self.stats["load_bytes"][tier.name] = (
                    self.stats["load_bytes"].get(tier.name, 0) + n * self.kv_bytes_block
                )
            prefix = hit + len(found)
            more = sum(sc.extra_hits(self, req, prefix) for sc in self.scenarios)
            cached = min((prefix + more) * self.bs, req.n_in)
            if req.hit is None:
                req.hit = {"hbm": hit} | {t.name: sum(1 for f in found if f is t) for t in self.tiers.lower}
                if more:
                    req.hit["reused"] = more  # beyond the prefix: position-independent reuse
            else:  # a recompute after preemption: what is not cached any more is computed again
                req.recomputed += max(0, req.context - cached)
                self.stats["recomputed_tokens"] += max(0, req.context - cached)
            # a recomputed request prefills its prompt and what it had generated
            req.todo = req.n_in + req.generated - cached
            req.context = cached
        if req.start < 0:
            req.start = now
        self.running.append(req)
        self.used += self.blocks_for(req.context + req.todo)
        return load_s

    def _fits(self, req: Req) -> bool:
        if self.slots:  # vLLM admits a request when its whole sequence fits, counting what its hit saves
            return self.cache.admission_need(req.row, req.n_in + req.generated) <= self._room()
        need = self.blocks_for((req.context if req.swapped else 0) + req.n_in + req.generated + 1)
        return need <= self._room()

    def rejection(self, req: Req) -> str:
        """What did not fit the empty pool: a request that was preempted after generating had a prompt that
        fitted, so its output is to blame, not its prompt."""
        pool = f"the instance's KV pool ({self.pool} blocks of {self.bs} tokens)"
        if req.generated:
            return (
                f"output does not fit: prompt ({req.n_in} tokens) plus the {req.generated} tokens generated "
                f"before preemption (of {req.n_out}) exceed {pool}"
            )
        return f"prompt ({req.n_in} tokens) larger than {pool}"

    def _room(self) -> int:
        """Blocks free for new KV: in a slot pool (vLLM's) its free queue, cached blocks no request holds
        included; otherwise the pool less the blocks running sequences hold."""
        return self.cache.free_blocks() if self.slots else self.pool - self.used

    def _take(self, r: Req, tokens: int) -> None:
        """A slot pool takes r's blocks for `tokens` tokens of KV as the step that computes them is scheduled."""
        if self.slots and r.cached_on == self.index:
            if tokens < r.grow_at and self._check_pool():
                self.cache.request = r.row  # as the skipped call would have left it
            else:
                self._grow(r, tokens)

    def _take_all(self, reqs: list[Req], more: int) -> None:
        """`_take(r, r.context + more)` for each of `reqs`, the per-decode hot path: most of these calls find
        the block being written has room and nothing to hash, and are skipped (see `_grow`)."""
        if not self.slots:
            return
        index, last = self.index, None
        if self._check_pool():
            grow = self._grow
            for r in reqs:
                if r.cached_on == index:
                    last = r
                    if r.context + more >= r.grow_at:
                        grow(r, r.context + more)
        else:
            grow = self.cache.grow
            for r in reqs:
                if r.cached_on == index:
                    last = r
                    grow(r.row, r.context + more)
        if last is not None:
            self.cache.request = last.row  # a skipped call leaves the pool's current request as a made one does

    def _check_pool(self) -> bool:
        """Whether a grow may be skipped below `grow_at`: the cache is vLLM's pool with its own `grow` (whose
        state `_grow` reads the threshold from), and it has filled (before, any grow may be the one that
        records `filled_at`)."""
        if self._pool is None:
            self._pool = isinstance(self.cache, VllmPool) and "grow" not in vars(self.cache)
        return self._pool and self.cache.out.filled_at >= 0

    def _grow(self, r: Req, tokens: int) -> None:
        """The pool's grow, then the KV length from which the next one has work: vLLM's pool hashes the
        request's first unhashed block once `tokens` covers it, and takes a slot once `tokens` passes the slots
        it holds; below both, grow changes nothing but the pool's `request`."""
        cache = self.cache
        cache.grow(r.row, tokens)
        if self._pool:
            held, pos = len(cache.held[r.row]), cache.unhashed_from[r.row]
            r.grow_at = (pos + 1) * self.bs if pos < held else held * self.bs + 1

    def _begin(self, req: Req) -> int:
        """Look the request up in the prefix cache and hold its hit; a pool that takes blocks step by step
        (vLLM's, with `grow`) takes the prompt's as its chunks are scheduled, not all at once."""
        req.grow_at = 0  # a new hold in the pool: its first grow is made
        if self.slots:
            return self.cache.begin(req.row, prompt_slots=False)
        return self.cache.begin(req.row)

    # --- preemption ---------------------------------------------------------------------------------------
    def _preempt(self, now: float) -> float:
        """Free the most recently scheduled sequence (vLLM's victim); returns seconds spent swapping out."""
        victim = self.running.pop()
        self.used -= self.blocks_for(victim.context + victim.todo)
        self.stats["preemptions"] += 1
        if victim.cached_on == self.index:
            self.cache.end(victim.row)
        mode = self.sched.preemption
        swap = mode == "swap" or (mode == "protect-after" and victim.generated > self.sched.protect_after)
        swap = swap or victim.handoff  # a decode instance cannot recompute: it has no prefill role
        self.enqueue(victim, front=True)
        if swap:
            victim.swapped = True
            n = self.blocks_for(victim.context) * self.kv_bytes_block
            self.stats["swap_bytes"] += n
            return self.latency.transfer_s(n, self.pcie_bw)
        victim.todo = 0  # recomputed from the cache state at re-admission
        return 0.0

    # --- one iteration --------------------------------------------------------------------------------------
    def plan(self, now: float):
        """Choose this iteration's work; returns (seconds it takes, prefill pieces, decoding requests, steps).
        A decode-only batch runs several identical iterations at once, up to the first request that finishes;
        an arrival cuts such a window short (cluster.simulate): what makes long traces quick."""
        self.now = now
        self._run_load = None
        bs = self.bs
        budget = self.sched.max_num_batched_tokens
        extra_s = 0.0
        # decodes that cross into a new block need one; preempt from the back until they fit
        decoding = [r for r in self.running if r.todo == 0]
        grow = [r.context % bs for r in decoding].count(0)
        while self.running and grow > self._room():
            extra_s += self._preempt(now)
            decoding = [r for r in self.running if r.todo == 0]
            grow = [r.context % bs for r in decoding].count(0)
        self.used += grow
        self._take_all(decoding, 1)
        budget -= len(decoding)
        pieces = []
        if budget > 0 and len(decoding) < len(self.running):  # running prefills take the next chunk
            for r in self.running:
                if r.todo > 0:
                    take = min(r.todo, budget)
                    pieces.append((r, take))
                    self._take(r, r.context + take)
                    budget -= take
                    if budget <= 0:
                        break
        if self.scenarios and len(self.waiting) > 1 and budget > 0 and len(self.running) < self.sched.max_num_seqs:
            self._order_waiting()  # (without scenarios the queue stays first come, first served: no sort)
        blocked = None  # the queue's head, found not to fit
        while self.waiting and budget > 0 and len(self.running) < self.sched.max_num_seqs:
            req = self.waiting[0]
            if not self._fits(req):
                if self.running:
                    blocked = req
                    break  # wait for running sequences to free blocks
                if any(sc.make_room(self) for sc in self.scenarios):
                    continue  # nothing runs: a scenario gives back KV it kept (a retained task's) and it is tried again
                self.rejected.append(self.dequeue())
                req.rejected_for = self.rejection(req)
                continue
            self.dequeue()
            extra_s += self._admit(req, now)
            if req.todo > 0:
                take = min(req.todo, budget)
                pieces.append((req, take))
                self._take(req, req.context + take)
                budget -= take
            else:
                decoding.append(req)
                self._take(req, req.context + 1)
                budget -= 1
        prefills, contexts = [(take, r.context) for r, take in pieces], [r.context for r in decoding]
        scenarios = self.scenarios
        if scenarios:  # (without them the single step's time is only needed when no window replaces it)
            step = self.latency.step_s(prefills, contexts)
            step += sum(sc.step_extra_s(self, prefills, contexts) for sc in scenarios)  # e.g. attn-ffn transfers
        steps = 1
        if (
            decoding
            and not pieces
            and not extra_s
            and (
                not self.waiting
                or len(self.running) >= self.sched.max_num_seqs
                # still blocked: nothing has changed the pool since (a scenario's step_extra_s might have)
                or (blocked is not None and not scenarios)
                or not self._fits(self.waiting[0])
            )
        ):
            steps = self._fast_forward(decoding)
        if steps > 1:
            n = len(decoding)
            if scenarios:
                mid = [c + (steps - 1) / 2 for c in contexts]  # KV grows linearly over the window
                extra = sum(sc.step_extra_s(self, [], mid) for sc in scenarios)
                step = (self.latency.step_s([], mid) + extra) * steps
            else:
                # the same window as step_s([], mid): sum(mid) adds integers and halves, exactly in floats, so
                # summing the integers first gives the very same float
                step = self.latency.decode_step_s(n, sum(contexts) + n * (steps - 1) / 2) * steps
            self._take_all(decoding, steps)
        elif not scenarios:
            step = self.latency.step_s(prefills, contexts)
        self.stats["steps"] += steps
        self._run_load = None
        return step + extra_s, pieces, decoding, steps

    def _order_waiting(self) -> None:
        """Reorder the waiting queue by the first scenario's `waiting_order` key (task-level scheduling), in
        place (other code holds the deque). Requests that already ran (preempted, start set) stay ahead, in
        their order: vLLM puts a preempted request back at the head of its queue."""
        for sc in self.scenarios:
            key = sc.waiting_order(self)
            if key is not None:
                order = sorted(self.waiting, key=lambda r: (r.start < 0, key(r) if r.start < 0 else 0))
                self.waiting.clear()
                self.waiting.extend(order)
                return

    def _fast_forward(self, decoding: list[Req]) -> int:
        k = min(min([r.n_out - r.generated for r in decoding]), MAX_FAST_FORWARD)
        if k <= 1:
            return 1
        # blocks the window's later steps need (the first step's were taken above); -(-x // bs) is blocks_for
        bs = self.bs
        more = sum([(r.context + 1) // -bs - (r.context + k) // -bs for r in decoding])
        if more > self._room():
            return 1  # the pool fills inside the window: step one at a time, preempting as needed
        return k  # finish_step takes the later steps' blocks, for as many steps as really ran

    def finish_step(self, t: float, pieces, decoding, steps: int = 1) -> list[Req]:
        """Apply an iteration (or `steps` identical decode iterations) that ended at time t; returns the
        requests that finished."""
        self.now = t
        self._run_load = None
        done = []
        for r, take in pieces:
            r.todo -= take
            r.context += take
            if r.todo == 0 and self.role == "prefill":  # disaggregated: the KV moves to a decode instance
                self.handed.append(r)
            elif r.todo == 0:  # the iteration that completes the prefill samples a token
                self._token(r, t, done)
        for r in self.handed:
            self.running.remove(r)
            self.used -= self.blocks_for(r.context)
            self.cache.end(r.row)
            r.handoff = True
        if steps > 1:  # the first step's block was taken when it was planned
            bs = self.bs
            self.used += sum([(r.context + 1) // -bs - (r.context + steps) // -bs for r in decoding])
        for r in decoding:  # each samples `steps` tokens (as _token, inlined: the per-decode hot path)
            r.context += steps
            r.generated += steps
            if r.first_token < 0:
                r.first_token = t
            if r.generated >= r.n_out:
                r.finish = t
                done.append(r)
        for r in done:
            self.running.remove(r)
            self.used -= self.blocks_for(r.context)
            if r.cached_on == self.index and not any(sc.retain(self, r) for sc in self.scenarios):
                self.cache.end(r.row)
        return done

    def _token(self, r: Req, t: float, done: list) -> None:
        r.generated += 1
        if r.first_token < 0:
            r.first_token = t
        if r.generated >= r.n_out:
            r.finish = t
            done.append(r)

    def occupancy(self) -> float:
        return min(1.0, self.used / self.pool) if self.pool else 0.0
