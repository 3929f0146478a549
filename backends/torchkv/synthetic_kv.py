"""Keys, values and queries of a model's geometry for a trace's own prompts, from a stated, seeded generative
assumption (docs/kv-quantization.md, "What the K/V are"). There is no trained model here, so the numbers follow
what published measurements of real KV caches report, not what any one model computes:

- Keys (per layer and KV head): a fixed per-channel mean plus per-token Gaussian noise, with a few *outlier
  channels* whose mean is several times larger: KIVI (arXiv 2402.02750) and KVQuant (arXiv 2401.18079) both find
  that keys have fixed large-magnitude channels while values do not. Rotary position embedding (RoPE, rotate-half
  pairs, base 500,000 as in Llama 3) is applied after, so the channel structure turns with position as it does in
  a real post-RoPE cache.
- Values: per-channel scales (log-normal) times per-token Gaussian noise and a per-token scale; no outlier
  channels.
- Queries: partly aligned with the keys' channel mean, partly noise, with RoPE at their own position. With RoPE
  the aligned part scores near keys higher than far ones (RoPE's long-term decay, Su et al., arXiv 2104.09864),
  so attention mixes a local peak with a broad tail.

Where the trace comes in: a token's K/V are drawn from a generator seeded by its prompt block's hash (and the
layer), so two requests that share a prefix get bit-identical K/V for it, and prompt lengths, output lengths and
block size are the trace's. Decode tokens (and the prompt's partial last block past the prompt) are seeded by
the request id and their block index.
"""

from __future__ import annotations

import hashlib
import math

import torch

from kvbench.models import ModelGeometry

ROPE_BASE = 500_000.0  # Llama 3's rope_theta
OUTLIER_SHARE = 1 / 32  # of a head's channels: 4 of 128
OUTLIER_MEAN = 8.0  # outlier channels' |mean|, in units of the ordinary channels' noise σ (= 1)
OUTLIER_SIGMA = 2.0
VALUE_CHANNEL_SIGMA = 0.5  # σ of log(value channel scale)
VALUE_TOKEN_SIGMA = 0.3  # σ of log(value token scale)
QUERY_ALIGNED_LOGIT = 3.0  # score (before softmax) of the query's aligned part against the key mean, same position
QUERY_NOISE = 0.5  # σ of the query's per-channel noise

_MASK64 = (1 << 64) - 1


def mix(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix64 finaliser over each part): stable across runs and machines."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (int(p) & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & _MASK64
        h ^= h >> 29
    return h & ((1 << 63) - 1)


def text_seed(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on `[n, heads, head_dim]` at `positions` `[n]`: channel c pairs with c + head_dim/2 and
    turns by position · base^(-2c/head_dim)."""
    half = x.shape[-1] // 2
    freq = ROPE_BASE ** (-torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    angle = (positions.double().cpu().unsqueeze(-1) * freq).float().unsqueeze(1).to(x.device)  # [n, 1, half]
    cos, sin = angle.cos(), angle.sin()
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class SyntheticKv:
    """The generative model of one model geometry and seed: per layer, the key channel means and outliers and
    the value channel scales (drawn once), then any sequence's K/V and queries on demand."""

    def __init__(self, model: ModelGeometry, block_tokens: int, seed: int = 0):
        self.model, self.block_tokens, self.seed = model, block_tokens, seed
        self.heads = model.heads or model.kv_heads
        self.group = self.heads // model.kv_heads
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def layer_params(self, layer: int):
        """(key mean `[H, D]`, key σ `[H, D]`, value channel scale `[H, D]`) of a layer."""
        if layer not in self._layers:
            H, D = self.model.kv_heads, self.model.head_dim
            gen = torch.Generator().manual_seed(mix(self.seed, layer, 1))
            mean = torch.randn(H, D, generator=gen)
            sigma = torch.ones(H, D)
            n_out = max(1, round(D * OUTLIER_SHARE))
            for h in range(H):
                idx = torch.randperm(D, generator=gen)[:n_out]
                signs = torch.randint(0, 2, (n_out,), generator=gen).float() * 2 - 1
                mean[h, idx] = OUTLIER_MEAN * signs
                sigma[h, idx] = OUTLIER_SIGMA
            v_scale = torch.exp(VALUE_CHANNEL_SIGMA * torch.randn(H, D, generator=gen))
            self._layers[layer] = (mean, sigma, v_scale)
        return self._layers[layer]

    def _draw_into(self, seed: int, layer: int, k, v, s) -> None:
        """One block's standard-normal draws (key noise, value noise, value token scale) into the given views."""
        gen = torch.Generator().manual_seed(mix(seed, layer, 2))
        for out in (k, v, s):
            torch.randn(out.shape, generator=gen, out=out)

    def sequence(self, block_hashes: list[int], prompt_tokens: int, request_id: str, length: int, layer: int):
        """(K, V), each `[length, kv_heads, head_dim]` fp32, of one request's first `length` tokens at `layer`:
        positions below `prompt_tokens` from the prompt blocks' hashes, the rest from the request's own seeds."""
        T, H, D = self.block_tokens, self.model.kv_heads, self.model.head_dim
        blocks = -(-length // T)
        own = text_seed(request_id)
        # drawn block by block into one buffer (a torch.cat of the pieces doubled the peak memory and its faults)
        zk, zv, zs = torch.empty(blocks * T, H, D), torch.empty(blocks * T, H, D), torch.empty(blocks * T, 1, 1)
        spare = torch.empty(T, H, D), torch.empty(T, H, D), torch.empty(T, 1, 1)
        for j in range(blocks):
            views = tuple(z[j * T : (j + 1) * T] for z in (zk, zv, zs))
            in_prompt = j < len(block_hashes) and j * T < prompt_tokens
            if in_prompt:
                self._draw_into(block_hashes[j], layer, *views)
            if (j + 1) * T > prompt_tokens:  # decode tokens: the request's own seed for this block
                self._draw_into(mix(own, j), layer, *(spare if in_prompt else views))
                if in_prompt:  # the prompt's partial last block, decoded into: its tail is the request's
                    tail = prompt_tokens - j * T
                    for view, drawn in zip(views, spare, strict=True):
                        view[tail:] = drawn[tail:]
        mean, sigma, v_scale = self.layer_params(layer)
        k = rope(zk[:length].mul_(sigma).add_(mean), torch.arange(length))
        v = zv[:length].mul_(v_scale).mul_(zs[:length].mul_(VALUE_TOKEN_SIGMA).exp_())
        return k, v

    def queries(self, request_id: str, positions: torch.Tensor, layer: int) -> torch.Tensor:
        """`[n, heads, head_dim]` queries at `positions` (each query head of a KV group draws its own noise)."""
        mean, _, _ = self.layer_params(layer)
        D = self.model.head_dim
        gen = torch.Generator().manual_seed(mix(text_seed(request_id), layer, 3))
        noise = QUERY_NOISE * torch.randn(len(positions), self.heads, D, generator=gen)
        # q·mean / √D = QUERY_ALIGNED_LOGIT for a key at the query's own position (RoPE turns both alike)
        aligned = mean / mean.norm(dim=-1, keepdim=True).square() * QUERY_ALIGNED_LOGIT * math.sqrt(D)
        return rope(aligned.repeat_interleave(self.group, dim=0) + noise, positions)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, old=None) -> torch.Tensor:
    """Grouped-query attention of queries `[n, heads, D]` over a cache `[S, kv_heads, D]`, query i seeing
    positions below lengths[i]; returns `[n, heads, D]` in fp32. `old`: (mask `[n, S]`, k_old, v_old): where the
    mask is set, the query reads k_old/v_old instead (the mixed policy's older blocks)."""
    n, heads, D = q.shape
    kv_heads = k.shape[1]
    qg = q.view(n, kv_heads, heads // kv_heads, D)
    scale = 1 / math.sqrt(D)
    scores = torch.einsum("nhgd,shd->nhgs", qg, k) * scale
    if old is not None:
        mask, k_old, v_old = old
        scores_old = torch.einsum("nhgd,shd->nhgs", qg, k_old) * scale
        scores = torch.where(mask[:, None, None, :], scores_old, scores)
    visible = torch.arange(k.shape[0], device=k.device).unsqueeze(0) < lengths.unsqueeze(1)
    p = torch.softmax(scores.masked_fill(~visible[:, None, None, :], float("-inf")), dim=-1)
    if old is None:
        out = torch.einsum("nhgs,shd->nhgd", p, v)
    else:
        m = mask[:, None, None, :].float()
        out = torch.einsum("nhgs,shd->nhgd", p * (1 - m), v) + torch.einsum("nhgs,shd->nhgd", p * m, v_old)
    return out.reshape(n, heads, D)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per query: ||out - ref|| / ||ref|| over all its heads' outputs (the attention block's output before the
    output projection)."""
    diff = (out - ref).flatten(1).norm(dim=1)
    return diff / ref.flatten(1).norm(dim=1).clamp_min(1e-30)
