"""Control for the copy task: a plain PyTorch GPT (4 layers, width 256, 4 heads, RoPE, pre-norm,
AdamW at a constant 3e-3 after 20 warmup steps, clip 1.0) on the same byte stream as train.py,
batches of 16 random 256-byte windows; prints the training loss every 20 steps.

    CORPUS=/tmp/copy python copy_reference.py STEPS
"""
import glob
import os
import sys

import torch

torch.manual_seed(0)
dev = "cuda" if torch.cuda.is_available() else "cpu"
CORPUS = os.environ.get("CORPUS", "/tmp/copy")
files = sorted(glob.glob(CORPUS + "/*.txt"))
data = []
for f in files:
    data += list(open(f, "rb").read()) + [256]
data = torch.tensor(data, device=dev)
# T, D, L, LR from the environment (the short-string runs: T=64 D=128 L=2)
T, B, D, H, L = int(os.environ.get("T", 256)), 16, int(os.environ.get("D", 256)), 4, int(os.environ.get("L", 4))
LR = float(os.environ.get("LR", 3e-3))
class Blk(torch.nn.Module):
    def __init__(s):
        super().__init__()
        s.n1 = torch.nn.LayerNorm(D); s.n2 = torch.nn.LayerNorm(D)
        s.qkv = torch.nn.Linear(D, 3 * D, bias=False); s.o = torch.nn.Linear(D, D, bias=False)
        s.ff = torch.nn.Sequential(torch.nn.Linear(D, 2 * D), torch.nn.GELU(), torch.nn.Linear(2 * D, D))
    def forward(s, x, cos, sin):
        b, t, _ = x.shape
        q, k, v = s.qkv(s.n1(x)).view(b, t, 3, H, D // H).unbind(2)
        def rope(z):
            z1, z2 = z[..., ::2], z[..., 1::2]
            return torch.stack([z1 * cos - z2 * sin, z1 * sin + z2 * cos], -1).flatten(-2)
        q, k = rope(q), rope(k)
        a = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + s.o(a.transpose(1, 2).reshape(b, t, D))
        return x + s.ff(s.n2(x))
emb = torch.nn.Embedding(257, D); blocks = torch.nn.ModuleList(Blk() for _ in range(L)); head = torch.nn.Linear(D, 257, bias=False); nf = torch.nn.LayerNorm(D)
for m in (emb, blocks, head, nf): m.to(dev)
params = list(emb.parameters()) + list(blocks.parameters()) + list(head.parameters()) + list(nf.parameters())
opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
hd = D // H
inv = 1.0 / (10000 ** (torch.arange(0, hd, 2) / hd))
ang = torch.arange(T)[:, None] * inv[None]
ang = ang.to(dev)
cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]
steps = int(sys.argv[1])
for step in range(1, steps + 1):
    lr = LR * min(1, step / 20)
    for g in opt.param_groups: g["lr"] = lr
    idx = torch.randint(0, len(data) - T - 1, (B,)).tolist()
    x = torch.stack([data[i:i + T] for i in idx]); y = torch.stack([data[i + 1:i + T + 1] for i in idx])
    h = emb(x)
    for b in blocks: h = b(h, cos, sin)
    loss = torch.nn.functional.cross_entropy(head(nf(h)).view(-1, 257), y.view(-1))
    opt.zero_grad(); loss.backward(); torch.nn.utils.clip_grad_norm_(params, 1.0); opt.step()
    if step % 20 == 0: print(step, round(loss.item(), 4), flush=True)
