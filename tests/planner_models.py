"""Models the planner tests plan, apply and train: a small GPT (attention and MLP blocks, which
tensor parallelism splits) and a small conv net (which it cannot split)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.n_head = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, self.n_head, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(d), Attention(d, heads), nn.LayerNorm(d), MLP(d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab=128, d=64, heads=4, layers=2, ctx=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(ctx, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, tokens):
        x = self.emb(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 16, 3, padding=1)])
        self.pool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(16, 10)

    def forward(self, x):
        for conv in self.layers:
            x = F.relu(conv(x))
        return self.fc(self.pool(x).flatten(1))


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build():
    return GPT()


def build_wide():
    """A GPT whose parameters and AdamW state are most of its memory."""
    return GPT(vocab=512, d=128, heads=4, layers=4, ctx=16)


_tokens = torch.randint(0, 128, (8, 17), generator=torch.Generator().manual_seed(1))


def batch():
    return _tokens[:, :-1], _tokens[:, 1:]


def build_conv():
    return ConvNet()


def conv_batch():
    g = torch.Generator().manual_seed(2)
    return torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)


def class_loss(logits, targets):
    return F.cross_entropy(logits, targets)
