"""Prototype: packed (varlen) batched forward over per-row DynamicCaches vs padded vs separate."""
import sys, time, torch
# run with the project installed
from transformers import DynamicCache

class PackedCache:
    """Per layer: keys = cat(all rows' pasts, new packed keys); appends new slices per row."""
    def __init__(self, caches, lens_new):
        self.caches = caches          # list of DynamicCache (batch 1)
        self.lens_new = lens_new
    def update(self, k, v, layer_idx, *args, **kwargs):
        # k: [1, H, M, D]
        pasts_k, pasts_v = [], []
        off = 0
        for c, n in zip(self.caches, self.lens_new):
            if layer_idx < len(c.layers) and c.layers[layer_idx].is_initialized and c.layers[layer_idx].keys.numel():
                pk, pv = c.layers[layer_idx].keys, c.layers[layer_idx].values
                pasts_k.append(pk); pasts_v.append(pv)
            c.update(k[:, :, off:off + n], v[:, :, off:off + n], layer_idx)
            off += n
        return torch.cat(pasts_k + [k], dim=2), torch.cat(pasts_v + [v], dim=2)

def packed_forward(model, rows):
    """rows: list of (DynamicCache, past_len, new_tokens list, keep). Returns list of [keep,V] logits."""
    dev = model.device
    caches = [r[0] for r in rows]
    L = [r[1] for r in rows]; N = [len(r[2]) for r in rows]
    M = sum(N); SL = sum(L)
    ids = torch.tensor([[t for r in rows for t in r[2]]], device=dev)
    pos = torch.tensor([[L[i] + j for i in range(len(rows)) for j in range(N[i])]], device=dev)
    # key rows: past block owner, new block owner
    q_row = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(N))
    k_row = torch.cat([torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(L)), q_row])
    k_pos = torch.cat([torch.cat([torch.arange(l) for l in L]) if SL else torch.empty(0, dtype=torch.long), pos[0].cpu()])
    mask = (q_row[:, None] == k_row[None, :]) & (k_pos[None, :] <= pos[0].cpu()[:, None])
    mask = mask[None, None].to(dev)
    keep_idx = []
    off = 0
    for i, r in enumerate(rows):
        keep_idx += list(range(off + N[i] - r[3], off + N[i])); off += N[i]
    out = model(input_ids=ids, position_ids=pos, attention_mask={"full_attention": mask},
                cache=PackedCache(caches, N), use_cache=True, logits_to_keep=torch.tensor(keep_idx, device=dev))
    lg = out.logits[0].float()
    res, o = [], 0
    for r in rows:
        res.append(lg[o:o + r[3]]); o += r[3]
    return res

def single_forward(model, cache, tokens, keep):
    ids = torch.tensor([tokens], device=model.device)
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=keep)
    return out.logits[0].float()

class PaddedCache:
    """Batch N; per layer keys [N,H,Lmax+Q,D]: row i = zeros(Lmax-L_i), past_i, new (Q)."""
    def __init__(self, caches, L, N):
        self.caches, self.L, self.N = caches, L, N
        self.Lmax = max(L)
    def update(self, k, v, layer_idx, *args, **kwargs):
        B, H, Q, D = k.shape
        K = k.new_zeros(B, H, self.Lmax + Q, D); V = v.new_zeros(B, H, self.Lmax + Q, D)
        for i, c in enumerate(self.caches):
            if self.L[i]:
                K[i, :, self.Lmax - self.L[i]:self.Lmax] = c.layers[layer_idx].keys[0]
                V[i, :, self.Lmax - self.L[i]:self.Lmax] = c.layers[layer_idx].values[0]
            c.update(k[i:i+1, :, :self.N[i]], v[i:i+1, :, :self.N[i]], layer_idx)
        K[:, :, self.Lmax:] = k; V[:, :, self.Lmax:] = v
        return K, V

def padded_forward(model, rows):
    dev = model.device
    caches = [r[0] for r in rows]
    L = [r[1] for r in rows]; N = [len(r[2]) for r in rows]
    B, Q, Lmax = len(rows), max(N), max(L)
    ids = torch.zeros(B, Q, dtype=torch.long)
    pos = torch.zeros(B, Q, dtype=torch.long)
    mask = torch.zeros(B, 1, Q, Lmax + Q, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, :N[i]] = torch.tensor(r[2])
        pos[i] = L[i] + torch.arange(Q)
        mask[i, 0, :, Lmax - L[i]:Lmax] = True
        mask[i, 0, :, Lmax:] = torch.tril(torch.ones(Q, Q, dtype=torch.bool))
    out = model(input_ids=ids.to(dev), position_ids=pos.to(dev), attention_mask={"full_attention": mask.to(dev)},
                cache=PaddedCache(caches, L, N), use_cache=True, logits_to_keep=Q)
    lg = out.logits.float()
    return [lg[i, N[i] - r[3]:N[i]] for i, r in enumerate(rows)]
