"""CPU emulation of the CUDA kernels' numerics for fp16 queries over a bf16 cache (FlashInfer's
"half" wrapper tests): the share of output elements that miss FlashInfer's fp16 tolerance
(|o - ref| > atol + 1e-3 |ref|, atol 1e-3 and the varlen test's 2e-3) when
  A: q is rounded to bf16 and P is bf16 (what the CUDA kernels do),
  B: q is exact (fp32 products of the fp16 values) and P is bf16,
  C: q is exact and P is fp16.
The reference is FlashInfer's: float32 logits, softmax, the output cast to fp16. One query token,
16 heads, 4 random draws a context length; docs/design/numerics.md keeps the table.

    python bench/numerics/f16_queries.py   (torch on the CPU)
"""
import math

import torch
torch.manual_seed(42)
def run(kv_len, heads=16, qo=1, trials=4):
    res = {}
    for t in range(trials):
        q = torch.randn(qo, heads, 576, dtype=torch.float16)
        kv = torch.randn(kv_len, 576, dtype=torch.bfloat16)
        k = kv.float(); v = kv[:, :512].float()
        scale = 1.0 / math.sqrt(192)
        logits = torch.einsum("mhd,nd->mhn", q.float(), k) * scale
        ref = torch.einsum("mhn,nd->mhd", torch.softmax(logits, -1), v).to(torch.float16).float()
        for name, qq, pdt in (("A q->bf16, P bf16", q.to(torch.bfloat16).float(), torch.bfloat16),
                              ("B q exact, P bf16", q.float(), torch.bfloat16),
                              ("C q exact, P fp16", q.float(), torch.float16)):
            s = torch.einsum("mhd,nd->mhn", qq, k) * scale
            m = s.amax(-1, keepdim=True)
            p = torch.exp(s - m)
            l = p.sum(-1, keepdim=True)
            o = torch.einsum("mhn,nd->mhd", p.to(pdt).float(), v) / l
            o = o.to(torch.float16).float()
            for atol in (1e-3, 2e-3):
                bad = ((o - ref).abs() > atol + 1e-3 * ref.abs()).float().mean().item()
                res.setdefault((name, atol), []).append(bad)
    return {k: sum(v) / len(v) for k, v in res.items()}
for n in (1, 3, 11, 17, 33, 79, 114, 514, 2743, 8736):
    r = run(n)
    print(f"kv {n:5d}: " + "  ".join(f"{k[0][:1]}@{k[1]:.0e} {100*v:5.2f}%" for k, v in r.items()))
