"""What decoder-only language models share: the causal-LM loss and the checks of a batch."""
from __future__ import annotations

import itertools
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100
ID_DTYPES = (torch.int64, torch.int32)  # what an embedding's lookup and the losses take
# The fused loss holds one chunk of tokens' fp32 logits at a time, about this many bytes: at GPT-2's vocabulary
# (50257) that is 333 tokens, so 8 x 1024 tokens take 25 chunks and the head's peak stays well under 1 GB
# instead of several copies of all tokens' logits; a small model's batch is one chunk. Smaller chunks would only
# add matmul launches and autograd nodes.
CHUNK_BYTES = 64 << 20


class HeadOutput:
    """What the fused loss computes the logits from: the final norm's hidden states and the LM head's weight and
    bias. Not a pytree node, so the runner's fp32 cast of a bf16 output passes it by (the loss casts each chunk's
    logits itself)."""
    __slots__ = ("hidden", "weight", "bias")

    def __init__(self, hidden, weight, bias):
        self.hidden, self.weight, self.bias = hidden, weight, bias


class LMHead(nn.Module):
    """A decoder's last piece, its final norm (if any) and LM head: the logits, or, once fused (a task with the
    default loss), a HeadOutput. OPT may project the hidden states out first; Gemma 2/3 softcap the logits (then
    the head is not fused: the chunked loss computes plain logits)."""

    def __init__(self, norm: nn.Module | None, lm_head: nn.Module, project_out: nn.Module | None = None,
                 softcap: float | None = None):
        super().__init__()
        self.norm, self.lm_head, self.project_out = norm, lm_head, project_out
        self.softcap = softcap
        self.fused = False

    def fuse(self):
        # Only a plain Linear is its weight and bias: a peft-wrapped head (LoRA on lm_head, trainable tokens)
        # computes more than F.linear(hidden, weight, bias), so it runs as it is and the loss takes its logits.
        self.fused = self.softcap is None and type(self.lm_head) is nn.Linear

    def forward(self, inputs):
        hidden = inputs[0] if self.norm is None else self.norm(inputs[0])
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        if self.fused:
            # Read at call time: the engine binds the parameters to their device copies for each visit.
            return HeadOutput(hidden, self.lm_head.weight, self.lm_head.bias)
        logits = self.lm_head(hidden)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def shifted_labels(labels):
    """Each position's target is the next token; the last position has none (IGNORE_INDEX). Every position's
    logits are then used as they are, none sliced off (which would copy them)."""
    return F.pad(labels[:, 1:].long(), (0, 1), value=IGNORE_INDEX)  # int32 labels too: the losses take int64


def causal_lm_loss(output, batch):
    """Hugging Face's causal-LM loss: predict token t+1 from tokens <= t, mean over labels != -100. `output` is
    the logits, or a fused head's HeadOutput (then computed chunk by chunk, the same loss)."""
    if isinstance(output, HeadOutput):
        return chunked_lm_loss(output, batch)
    labels = shifted_labels(batch["labels"].to(output.device))
    return F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX)


def chunked_lm_loss(head: HeadOutput, batch):
    """The causal-LM loss with the LM head computed chunk by chunk (see _ChunkedHeadLoss): the logits of all
    tokens never exist at once."""
    hidden = head.hidden.reshape(-1, head.hidden.shape[-1])
    labels = shifted_labels(batch["labels"].to(hidden.device)).reshape(-1)
    rows = max(1, CHUNK_BYTES // (4 * head.weight.shape[0]))
    return _ChunkedHeadLoss.apply(hidden, head.weight, head.bias, labels, rows, torch.is_grad_enabled())


class _ChunkedHeadLoss(torch.autograd.Function):
    """F.cross_entropy's mean of F.linear(hidden, weight, bias) against `labels`, `rows` tokens at a time.

    The gradients are taken in the forward, chunk by chunk, while each chunk's logits exist (the loss is the
    graph's end, so its gradient is only scaled by the backward's scalar): no logits are kept or recomputed.
    Each chunk's are autograd's own through the same ops as the plain loss, so one chunk gives the plain
    loss's gradients bit for bit. The head's weight and bias gradients are summed over the chunks in fp32,
    scaled by the backward's scalar and only then rounded to their dtype, once, as one matmul over all tokens
    would round them; summed by autograd in bf16, many chunks would round each."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, rows: int, with_grads: bool):
        count = (labels != IGNORE_INDEX).sum()
        # What the plain mean's backward hands each kept label; every label ignored: zero gradients, a nan loss.
        per_label = 1.0 / count.clamp_min(1).float()
        total = hidden.new_zeros((), dtype=torch.float32)
        grad_hidden = torch.empty_like(hidden) if with_grads else None
        sums = [torch.zeros_like(p, dtype=torch.float32) for p in (weight, bias) if p is not None] if with_grads else []
        for start in range(0, hidden.shape[0], rows):
            with torch.enable_grad():
                leaves = [t.detach().requires_grad_(with_grads) for t in (hidden[start:start + rows], weight, bias)
                          if t is not None]
                chunk = F.nll_loss(torch.log_softmax(F.linear(*leaves).float(), dim=-1),
                                   labels[start:start + rows], ignore_index=IGNORE_INDEX, reduction="sum")
                if with_grads:
                    grad, *head = torch.autograd.grad(chunk * per_label, leaves)
                    grad_hidden[start:start + rows] = grad
                    for into, g in zip(sums, head):
                        into += g
            total += chunk.detach()
        if with_grads:
            ctx.dtype = weight.dtype
            ctx.save_for_backward(grad_hidden, *sums)
        return total / count  # 0 / 0 = nan when every label is ignored, as F.cross_entropy's mean

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight, *grad_bias = ctx.saved_tensors
        head = [(g * grad_total).to(ctx.dtype) for g in (grad_weight, *grad_bias)]
        return grad_hidden * grad_total.to(grad_hidden.dtype), head[0], head[1] if grad_bias else None, None, None, None


def positions_and_mask(config, input_ids, embeds, attention_mask, position_ids=None):
    """The batch's position ids, else 0..T-1, and the model's own causal mask (None where its attention applies
    causality itself), as the Hugging Face model computes them without a cache."""
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
    mask = make_mask("full_attention", config, embeds, attention_mask, mask_positions(config, position_ids))
    return position_ids, mask


def make_mask(kind: str, config, embeds, attention_mask, position_ids):
    """The model's own mask of an attention type ("full_attention" or "sliding_attention"), without a cache."""
    from transformers import masking_utils

    make = {"full_attention": masking_utils.create_causal_mask,
            "sliding_attention": masking_utils.create_sliding_window_causal_mask}[kind]
    # The cache goes by position: transformers renamed that parameter (past_key_values -> cache) during 5.x.
    return make(config, embeds, attention_mask, None, position_ids=position_ids)


def mask_positions(config, position_ids):
    """The position ids the model's mask functions see. A model whose config caches (use_cache, the default) makes
    a cache in its training forward too, and with a cache the mask functions do not look for packed sequences in
    the position ids; without one they do (restarting ids and no attention_mask: a block-diagonal mask). The
    pieces have no cache, so they hand the ids over only where the model would find packing itself."""
    return None if getattr(config, "use_cache", False) else position_ids


def inputs(batch):
    return batch["input_ids"], batch.get("attention_mask"), batch.get("position_ids")


def described(value) -> str:
    """A batch or one of its fields as a message names it: a tensor's shape and dtype, a mapping's keys, else its
    type."""
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {value.dtype}"
    if type(value).__module__ == "numpy" and hasattr(value, "dtype"):
        return f"a NumPy array {tuple(value.shape)} {value.dtype}"
    if value is None:
        return "None"
    name = type(value).__name__
    kind = f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"
    if isinstance(value, Mapping):
        keys = [repr(key) for key in itertools.islice(value, 7)]
        return f"{kind} of {', '.join(keys[:6])}{', ...' if len(keys) > 6 else ''}" if keys else f"an empty {name}"
    return kind


def tensors_hint(value) -> str:
    """What to do with a tokenizer's output that is no tensor (return_tensors="np", or none: lists)."""
    numpy = type(value).__module__ == "numpy"
    return (": give the batch torch tensors (a tokenizer's return_tensors='pt', or a DataLoader's collator)"
            if numpy or isinstance(value, (list, tuple)) else "")


def check_labels(labels, shape, vocab_size: int):
    """Labels of input_ids' shape, each a token id or IGNORE_INDEX: the loss's lookup of any other fails mid-run,
    on CUDA as a device-side assert."""
    if not isinstance(labels, torch.Tensor) or labels.dtype not in ID_DTYPES:
        raise ValueError(f"labels must be an int64 (or int32) tensor of input_ids' shape {tuple(shape)}, got "
                         f"{described(labels)}{tensors_hint(labels)}")
    if labels.shape != shape:
        raise ValueError(f"labels {tuple(labels.shape)} must have the shape of input_ids {tuple(shape)}")
    outside = labels[((labels < 0) & (labels != IGNORE_INDEX)) | (labels >= vocab_size)].unique().tolist()
    if outside:
        raise ValueError(f"labels must lie in [0, {vocab_size}) or be {IGNORE_INDEX} (ignored); found "
                         f"{', '.join(map(str, outside[:4]))}{', ...' if len(outside) > 4 else ''}: does the "
                         "tokenizer match the model?")
    if not bool((labels[:, 1:] != IGNORE_INDEX).any()):
        what = (f"every label the loss uses (labels[:, 1:]) is {IGNORE_INDEX}" if labels[:, 1:].numel() else
                f"input_ids {tuple(shape)} leave no token to predict")
        raise ValueError(f"{what}: the batch's loss would be 0 / 0 = nan; give it labels or leave it out")


def check_range(label: str, values: torch.Tensor, low: int, high: int, what: str, hint: str = "") -> None:
    """Refuses ids outside [low, high), naming what they index: an embedding's lookup of one fails mid-run, on CUDA
    as a device-side assert that ends every task of the process."""
    if values.numel() and (int(values.max()) >= high or int(values.min()) < low):
        raise ValueError(f"{label} must lie in [{low}, {high}) ({what}); found [{int(values.min())}, "
                         f"{int(values.max())}]{hint}")


def batch_checker(vocab_size: int, max_positions: int | None, lowest_position: int = 0):
    """Checks of a batch before anything runs. `max_positions`: a model with learned positions (GPT-2, OPT) holds
    that many, so longer sequences and position ids outside [lowest_position, max_positions) are refused (an
    embedding lookup out of range would fail mid-run, on CUDA as a device-side assert that ends every task).
    `labels`: the batch's labels are the causal-LM loss's (with a loss_fn of the user's they are its own)."""
    def check_batch(batch, labels: bool):
        # A mapping: a dict, or the BatchEncoding of a tokenizer or DataCollatorForLanguageModeling.
        if not isinstance(batch, Mapping) or "input_ids" not in batch or (labels and "labels" not in batch):
            if isinstance(batch, Mapping) and "inputs_embeds" in batch:
                raise KeyError("batches with 'inputs_embeds' are not supported: pass 'input_ids' (the embeddings "
                               "are the model's first shard)")
            needs = "'input_ids' and 'labels'" if labels else "'input_ids'"
            raise KeyError(f"a language-model batch is a dict with {needs} (and optionally 'attention_mask' and "
                           f"'position_ids'); got {described(batch)}")
        if "inputs_embeds" in batch:
            raise KeyError("a batch has both 'input_ids' and 'inputs_embeds': hydra-torch embeds 'input_ids' "
                           "in the model's first shard; drop 'inputs_embeds'")
        ids = batch["input_ids"]
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in ID_DTYPES:
            one_example = (isinstance(ids, torch.Tensor) and ids.dim() == 1) or (  # a tokenized dataset's item
                isinstance(ids, (list, tuple)) and not any(isinstance(i, (list, tuple)) for i in ids))
            raise ValueError("input_ids must be an int64 (or int32) tensor (batch, sequence), got " + described(ids) +
                             ("; each item of data is one batch, not one example: batch the examples with a "
                              "DataLoader (collate_fn=DataCollatorForLanguageModeling(tokenizer, mlm=False))"
                              if one_example else tensors_hint(ids)))
        if max_positions is not None and ids.shape[1] > max_positions:
            raise ValueError(f"sequence length {ids.shape[1]} exceeds the model's n_positions={max_positions}")
        check_range("token ids", ids, 0, vocab_size, "the model's vocab_size", ": does the tokenizer match the model?")
        if labels:
            check_labels(batch["labels"], ids.shape, vocab_size)
        mask = batch.get("attention_mask")
        if mask is not None and not isinstance(mask, torch.Tensor):
            raise ValueError(f"attention_mask must be a tensor of input_ids' shape {tuple(ids.shape)}, got "
                             f"{described(mask)}{tensors_hint(mask)}")
        if mask is not None and mask.shape != ids.shape:
            raise ValueError(f"attention_mask {tuple(mask.shape)} must have the shape of input_ids {tuple(ids.shape)}")
        positions = batch.get("position_ids")
        if positions is not None and (not isinstance(positions, torch.Tensor) or positions.dim() != 2
                                      or positions.shape[1] != ids.shape[1]
                                      or positions.shape[0] not in (1, ids.shape[0])):
            raise ValueError(f"position_ids must be (batch or 1, sequence) for input_ids {tuple(ids.shape)}, got "
                             f"{described(positions)}{tensors_hint(positions)}")
        if positions is not None and max_positions is not None and positions.dtype not in ID_DTYPES:
            raise ValueError(f"position_ids must be an int64 (or int32) tensor, the indices of the model's learned "
                             f"positions, got {described(positions)}")
        if positions is not None and max_positions is not None:
            check_range("position_ids", positions, lowest_position, max_positions, "the model's learned positions")

    return check_batch
