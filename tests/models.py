"""Small models and a plain-PyTorch reference loop shared by the tests."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, SEQ = 48, 32, 12


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and an MLP, with dropout."""

    def __init__(self, width: int = WIDTH, heads: int = 4, dropout: float = 0.1):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        # No qkv bias: the key bias has an exactly-zero gradient (softmax ignores it), and Adam scales the
        # rounding noise left there up to full-size updates, which would compare noise, not training.
        self.qkv, self.proj = nn.Linear(width, 3 * width, bias=False), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.drop(self.proj(att))
        return x + self.drop(self.mlp(self.ln2(x)))


def tied_transformer(seed: int = 0, blocks: int = 5, dropout: float = 0.1) -> nn.Sequential:
    """Embedding, blocks, final norm, and a head tied to the embedding: blocks + 3 layers."""
    torch.manual_seed(seed)
    embed = nn.Embedding(VOCAB, WIDTH)
    head = nn.Linear(WIDTH, VOCAB, bias=False)
    head.weight = embed.weight
    return nn.Sequential(embed, *[Block(dropout=dropout) for _ in range(blocks)], nn.LayerNorm(WIDTH), head)


def token_batches(count: int, batch: int = 4, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(count):
        tokens = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g)
        data.append((tokens[:, :-1], tokens[:, 1:]))
    return data


class OneShot:
    """`n` token batches, sized, that can be drawn once (iter() returns the same iterator)."""

    def __init__(self, n: int):
        self.items = iter(token_batches(n))
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.items)


def lm_loss(output, batch):
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), batch[1].reshape(-1).to(output.device))


def model_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def train_plain(model, data, make_optimizer, accumulate: int = 1, clip: float | None = None, seed: int = 123,
                make_scheduler=None):
    """The reference: the usual PyTorch loop, averaging the loss over `accumulate` micro-batches;
    `make_scheduler(optimizer)`: an LR scheduler stepped after each optimizer step."""
    optimizer = make_optimizer(model.parameters())
    scheduler = make_scheduler(optimizer) if make_scheduler is not None else None
    torch.manual_seed(seed)
    losses = []
    for start in range(0, len(data), accumulate):
        group = data[start:start + accumulate]
        optimizer.zero_grad()
        total = 0.0
        for batch in group:
            loss = lm_loss(model(batch[0]), batch)
            (loss / len(group)).backward()
            total += loss.item()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(total / len(group))
    return losses


def max_relative_error(model_a: nn.Module, model_b: nn.Module) -> float:
    worst = 0.0
    for (name, a), (_, b) in zip(model_a.named_parameters(), model_b.named_parameters()):
        scale = b.detach().abs().max().clamp_min(1e-12)
        worst = max(worst, ((a.detach() - b.detach()).abs().max() / scale).item())
    return worst
