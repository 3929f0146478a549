"""Real attention over a paged KV pool: a small attention-only transformer with seeded random weights whose
K/V live in the caller's pool tensor, so that reusing a prefix means reusing pages and a cache miss costs
actual prefill compute instead of a modelled number.

Outputs mean nothing linguistically; what matters is that a paged run gives the same hidden states as
`contiguous_forward` over the whole sequence, which is what proves that the pages hold the right K/V at the
right positions (the tests check exactly that).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from kvbench.backends.torchkv.geometry import KvGeometry, layer_kv

from kvbench.errors import KvbenchError

VOCAB = 4096  # kvbench-tiny's vocabulary; prompts.prompt_tokens draws ids below it
_COMPUTE_DTYPES = ("bf16", "fp16", "fp32")


class PagedAttentionModel:
    def __init__(self, geometry: KvGeometry, device: torch.device | str = "cpu", seed: int = 0):
        m = geometry.model
        if geometry.dtype not in _COMPUTE_DTYPES or m.mla:
            what = "an MLA (latent) cache" if m.mla else f"a {geometry.dtype} cache"
            raise KvbenchError(
                f"torchkv compute needs bf16/fp16/fp32 and non-MLA KV, but {m.name!r} has {what}; run compute "
                f"with a non-MLA model at bf16, fp16 or fp32 (e.g. KvGeometry.named('kvbench-tiny', "
                f"{geometry.block_tokens}, 'bf16')), or benchmark this pool's KV movement without compute"
            )
        self.geometry = geometry
        self.layout = geometry.layout
        self.device = torch.device(device)
        self.dtype = geometry.torch_dtype
        self.layers, self.kv_heads, self.head_dim = m.layers, m.kv_heads, m.head_dim
        self.heads = m.heads or m.kv_heads
        if self.heads % self.kv_heads:
            raise KvbenchError(f"model {m.name!r}: {self.heads} query heads do not split over {self.kv_heads} KV heads")
        self.group = self.heads // self.kv_heads
        self.hidden = m.hidden or self.heads * self.head_dim
        self.block_tokens = geometry.block_tokens
        self.computed_tokens = 0

        # Drawn in fp32 on the CPU generator, then cast and moved: the same seed gives the same model on any
        # device, so a CPU run and a GPU run of one trace can be compared.
        gen = torch.Generator().manual_seed(seed)

        def draw(rows: int, cols: int, fan_in: int) -> torch.Tensor:
            w = torch.randn(rows, cols, generator=gen) / math.sqrt(fan_in)
            return w.to(self.device, self.dtype)

        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self._split = (q_width, kv_width, kv_width)
        self.embed = draw(VOCAB, self.hidden, 1)
        # q, k and v fused into one matrix per layer: one matmul per layer instead of three, which is most of
        # a decode step's Python overhead at this size.
        self.wqkv = [draw(self.hidden, q_width + 2 * kv_width, self.hidden) for _ in range(self.layers)]
        self.wo = [draw(q_width, self.hidden, q_width) for _ in range(self.layers)]

    def prefill(self, pool: torch.Tensor, block_table: torch.Tensor, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Compute positions start..len(tokens)-1 over a context whose first `start` positions are already in
        the pages of `block_table` (block i holds positions i*T..i*T+T-1), writing the new positions' K/V.
        Returns the last position's hidden state. With start == len(tokens) only the last token's query is
        recomputed (its K/V is left as is), as engines do on a full prefix hit, so there is always an output."""
        tokens = torch.as_tensor(tokens, dtype=torch.long).to(self.device)
        n = tokens.shape[0]
        if tokens.dim() != 1 or n == 0 or not 0 <= start <= n:
            raise KvbenchError(f"prefill needs a non-empty 1-D token list and 0 ≤ start ≤ {n}, got start={start}")
        bt = self._table(pool, block_table, n)
        q_start = min(start, n - 1)
        self.computed_tokens += n - q_start
        return self._run(pool, bt, tokens[q_start:], q_start, n, write=start < n)

    def decode(self, pool: torch.Tensor, block_table: torch.Tensor, position: int, token: int) -> torch.Tensor:
        bt = block_table if block_table.device == self.device else block_table.to(self.device)
        x = self.embed[token].unsqueeze(0)
        return self._run(pool, bt, None, position, position + 1, write=True, x=x)

    def contiguous_forward(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = torch.as_tensor(tokens, dtype=torch.long).to(self.device)
        with torch.inference_mode():
            x = F.embedding(tokens, self.embed)
            for layer in range(self.layers):
                q, k, v = self._qkv(x, layer)
                out = self._attend(q, k, v, causal=True)
                x = torch.addmm(x, out, self.wo[layer])
            return x[-1]

    def _table(self, pool: torch.Tensor, block_table: torch.Tensor, n: int) -> torch.Tensor:
        if pool.dtype != self.dtype or pool.device.type != self.device.type:
            raise KvbenchError(
                f"pool is {pool.dtype} on {pool.device} but the model computes in {self.dtype} on {self.device}; "
                "allocate the pool from the same KvGeometry and device"
            )
        need = -(-n // self.block_tokens)
        if block_table.numel() < need:
            raise KvbenchError(
                f"{n} tokens need {need} blocks of {self.block_tokens}, but the block table names "
                f"{block_table.numel()}; allocate the request's blocks before prefill"
            )
        return block_table.to(self.device, torch.long)

    def _run(self, pool, bt, tokens_q, q_start: int, ctx: int, write: bool, x=None) -> torch.Tensor:
        T = self.block_tokens
        with torch.inference_mode():
            if x is None:
                x = F.embedding(tokens_q, self.embed)
            L = x.shape[0]
            pages = bt[: -(-ctx // T)]
            if L == 1:
                # a slice, not bt[i]: a 0-d index would be read back to the host (a sync on a GPU)
                blk, off = bt[q_start // T : q_start // T + 1], q_start % T
            else:
                pos = torch.arange(q_start, q_start + L, device=self.device)
                blk, off = bt[pos // T], pos % T
            # Fewer queries than keys: query i sits at position ctx-L+i and sees keys 0..ctx-L+i (causal mask
            # aligned lower right). Built here rather than via causal_lower_right because CausalBias's lower-right
            # path calls the fused kernels directly and drops enable_gqa; a plain mask keeps the dispatcher's
            # GQA handling. Built once per call, shared by every layer.
            mask = None
            if 1 < L < ctx:
                mask = torch.ones(L, ctx, dtype=torch.bool, device=self.device).tril(ctx - L)
            for layer in range(self.layers):
                K, V = layer_kv(pool, self.layout, layer)
                q, k, v = self._qkv(x, layer)
                if write:
                    K[blk, off] = k
                    V[blk, off] = v
                # Whole pages gathered then trimmed: one index_select per cache, and pages need not be adjacent
                ck = K.index_select(0, pages).flatten(0, 1)[:ctx]
                cv = V.index_select(0, pages).flatten(0, 1)[:ctx]
                out = self._attend(q, ck, cv, causal=L == ctx, mask=mask)
                x = torch.addmm(x, out, self.wo[layer])
            return x[-1]

    def _qkv(self, x: torch.Tensor, layer: int):
        L = x.shape[0]
        q, k, v = (x @ self.wqkv[layer]).split(self._split, dim=-1)
        return (
            q.view(L, self.heads, self.head_dim),
            k.view(L, self.kv_heads, self.head_dim),
            v.view(L, self.kv_heads, self.head_dim),
        )

    def _attend(self, q, k, v, causal: bool, mask=None) -> torch.Tensor:
        """q [L, heads, D] against k, v [S, kv_heads, D]; returns [L, heads*D]."""
        L = q.shape[0]
        k = k.transpose(0, 1).unsqueeze(0)
        v = v.transpose(0, 1).unsqueeze(0)
        if L == 1:
            # One query sees every key, so no mask; the query heads sharing a KV head are folded into the query
            # length, which is plain attention (no GQA expansion) and measurably cheaper per decode step.
            q = q.view(1, self.kv_heads, self.group, self.head_dim)
            out = F.scaled_dot_product_attention(q, k, v)
            return out.reshape(1, self.heads * self.head_dim)
        q = q.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal and mask is None, enable_gqa=True
        )
        return out[0].transpose(0, 1).reshape(L, self.heads * self.head_dim)
