"""Text and tokens available offline: the Python standard library's sources as a corpus, and a GPT-2-style
byte-level BPE tokenizer trained on it locally with `tokenizers`."""
from __future__ import annotations

import glob
import os
import sysconfig

import torch


def local_text(max_bytes: int = 4_000_000) -> str:
    """Up to `max_bytes` of text from the standard library's .py files (present wherever Python is)."""
    root = sysconfig.get_paths()["stdlib"]
    parts, total = [], 0
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        try:
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    if not parts:
        raise RuntimeError(f"no text found under {root} to train on")
    return "\n".join(parts)[:max_bytes]


def train_tokenizer(text: str, vocab_size: int):
    """A byte-level BPE tokenizer (GPT-2's scheme) trained on `text`."""
    from tokenizers import ByteLevelBPETokenizer

    tokenizer = ByteLevelBPETokenizer()
    chunk = 100_000
    tokenizer.train_from_iterator((text[i:i + chunk] for i in range(0, len(text), chunk)), vocab_size=vocab_size,
                                  min_frequency=2, special_tokens=["<|endoftext|>"], show_progress=False)
    return tokenizer


def lm_batches(ids: torch.Tensor, batch: int, seq: int, count: int, generator: torch.Generator) -> list[dict]:
    """`count` batches of random windows of `seq` tokens, as {"input_ids", "labels"} (labels = inputs: the
    causal-LM loss shifts them)."""
    if ids.numel() <= seq:
        raise ValueError(f"the corpus has {ids.numel()} tokens, fewer than one sequence of {seq}")
    out = []
    for _ in range(count):
        starts = torch.randint(0, ids.numel() - seq, (batch,), generator=generator)
        windows = torch.stack([ids[s:s + seq] for s in starts.tolist()])
        out.append({"input_ids": windows, "labels": windows.clone()})
    return out
