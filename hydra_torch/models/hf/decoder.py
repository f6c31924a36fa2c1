"""Decoder-only Hugging Face causal LMs as pieces, found by structure instead of by class: token embeddings, each
decoder layer, final norm + LM head.

The parts are read off the model itself: its base (`base_model_prefix`), the ModuleList of its decoder layers
(`_no_split_modules` names their class), the input and output embeddings (`get_input_embeddings`,
`get_output_embeddings`), and beside the layers a final norm, a rotary embedding and, for OPT, learned positions
and projections. Every other part is refused by name (KNOWN_PARTS): a module the adapter did not place would
silently not run. What differs between families is in the config: per-layer attention types (`layer_types`:
full or sliding window), a sliding window for every layer (`sliding_window`, as Mistral), Gemma 2/3's final
logit softcapping, OPT's layer drop. Gemma's embedding scale lives in its embedding module and needs nothing.

As for GPT-2, the pieces hold the model's own submodules, so training updates the user's model in place and
tied embeddings stay tied. Between pieces travels (hidden_states, Carried((masks, tables)), position_ids): the
first piece computes, once per micro-batch, a mask per attention type with the model's own mask functions
(padding in `attention_mask` and the attention implementation behave as in HF) and the rotary (cos, sin) with
the model's own rotary module; Carried, they take no gradient at the shard boundaries (see models/carried.py).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from hydra_torch.models.carried import Carried
from hydra_torch.models.hf import causal_lm

FINAL_NORMS = ("norm", "final_layernorm", "final_layer_norm")
EMBEDDING_DROPOUTS = ("embed_dropout", "emb_dropout")
EMBEDDING_DROPOUT_RATES = ("embedding_dropout",)     # Starcoder2: a number its forward passes to F.dropout
ROTARY = "rotary_emb"
LEARNED_POSITIONS = "embed_positions"                  # OPT: added to the token embeddings, offset by 2
PROJECTIONS = ("project_in", "project_out")           # OPT-350m: embeddings narrower than the layers
KNOWN_PARTS = set(FINAL_NORMS) | set(EMBEDDING_DROPOUTS) | {ROTARY, LEARNED_POSITIONS} | set(PROJECTIONS)
MASK_TYPES = ("full_attention", "sliding_attention")
# Tested against plain training, layer by layer and after training (tests/test_hf_decoders.py); other models whose
# parts are all found train too, after the same self-check as these (their pieces' logits equal the model's own).
TESTED = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "phi", "phi3", "gemma", "gemma2", "gemma3_text",
          "olmo", "olmo2", "smollm3", "gpt_neox", "opt")


@dataclass
class Parts:
    decoder: nn.Module                # the module holding the layers, the norm and the rotary embedding
    embed: nn.Module
    layers: list[nn.Module]
    norm: nn.Module | None
    head: nn.Module
    rotary: nn.Module | None
    extras: dict[str, nn.Module]      # dropout, learned positions, projections, by their names


def find_parts(model) -> Parts:
    """The decoder's parts, or a TypeError naming the first one not found (or not understood)."""
    name = type(model).__name__
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if not isinstance(base, nn.Module):
        raise TypeError(f"not supported: {name} has no base model at .{model.base_model_prefix}")
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    holders = [(path, module) for path, module in base.named_modules()
               if isinstance(module, nn.ModuleList) and len(module)
               and all(type(layer).__name__ in layer_classes for layer in module)]
    if len(holders) != 1:
        found = "no" if not holders else f"{len(holders)} ({', '.join(p for p, _ in holders)})"
        raise TypeError(f"not supported: {name}: found {found} list of decoder layers (of {sorted(layer_classes)}) "
                        f"in .{model.base_model_prefix}; hydra-torch shards decoder-only causal LMs whose base keeps "
                        "its layers in one ModuleList")
    path, layers = holders[0]
    decoder = base.get_submodule(path.rpartition(".")[0]) if "." in path else base
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise TypeError(f"not supported: {name} has no LM head (get_output_embeddings() is {head!r})")
    children = dict(decoder.named_children())
    layers_name = path.rpartition(".")[2]
    embed_name = next((n for n, m in children.items() if m is embed), None)
    if embed_name is None:
        raise TypeError(f"not supported: {name}: its input embeddings are not beside its decoder layers "
                        f"(in {type(decoder).__name__})")
    unknown = sorted(n for n, m in children.items() if n not in KNOWN_PARTS | {layers_name, embed_name})
    if unknown:
        raise TypeError(f"not supported: {name}: {type(decoder).__name__} holds parts whose place in the forward "
                        f"hydra-torch does not know: {', '.join(unknown)}")
    placed = {id(p) for m in [decoder, head] for p in m.parameters()}
    stray = next((n for n, p in model.named_parameters() if id(p) not in placed), None)
    if stray is not None:
        raise TypeError(f"not supported: {name}: parameter {stray} is outside the decoder and the LM head")
    count = getattr(model.config, "num_hidden_layers", len(layers))
    return Parts(decoder=decoder, embed=embed, layers=list(layers)[:count],
                 norm=next((children[n] for n in FINAL_NORMS if children.get(n) is not None), None),
                 head=head, rotary=children.get(ROTARY),
                 extras={n: children[n] for n in children if n in KNOWN_PARTS - set(FINAL_NORMS) - {ROTARY}
                         and children[n] is not None})


def forward_source(decoder) -> str | None:
    """The source of the decoder's forward (what its decorators wrap), None where Python has none."""
    try:
        return inspect.getsource(type(decoder).forward)
    except (OSError, TypeError):
        return None


def layer_mask_types(decoder, config) -> list[str]:
    """Each layer's attention type, as the decoder's own forward chooses its masks: by `config.layer_types` where
    the forward reads them (Qwen2/3, Gemma 2/3), else one sliding-window mask for every layer where it makes one
    and the config sets a window (Mistral, Mixtral, Phi-3), else full causal attention. Read off the forward's
    source, since configs carry keys their model ignores (a Ministral-style `layer_types` on a Mistral, a stray
    `sliding_window` on a Llama)."""
    count = config.num_hidden_layers
    source = forward_source(decoder)
    if source is None:  # no source: the config decides
        source = "layer_types create_sliding_window_causal_mask"
    types = getattr(config, "layer_types", None)
    if types is not None and "layer_types" in source:
        unknown = sorted(set(types[:count]) - set(MASK_TYPES))
        if unknown:
            raise TypeError(f"not supported: layer types {unknown} (hydra-torch builds masks for {list(MASK_TYPES)})")
        return list(types[:count])
    sliding = "create_sliding_window_causal_mask" in source and getattr(config, "sliding_window", None) is not None
    return ["sliding_attention" if sliding else "full_attention"] * count


class Embeddings(nn.Module):
    """The first piece: the hidden states, and once per micro-batch what every layer takes beside them (Carried
    along the shards): a mask per attention type, and the rotary (cos, sin) per table (one, or Gemma 3's one per
    layer type)."""

    def __init__(self, parts: Parts, config, types: tuple[str, ...], tables: tuple[str | None, ...]):
        super().__init__()
        self.embed_tokens = parts.embed
        for name, module in parts.extras.items():
            if name != "project_out":
                setattr(self, name, module)
        # Not a child: its inv_freq buffer stays where the model keeps it, and the module moves it to the hidden
        # states' device as it computes.
        self._rotary = [parts.rotary]
        self._decoder = [parts.decoder]  # not a child either: its rates are read as its own forward reads them
        self.config, self.types, self.tables = config, types, tables

    def forward(self, inputs):
        input_ids, attention_mask, position_ids = inputs
        embeds = self.embed_tokens(input_ids)
        positions = getattr(self, LEARNED_POSITIONS, None)
        if positions is None:
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
            mask_positions = causal_lm.mask_positions(self.config, position_ids)
        else:  # OPT: positions count the attended tokens, as its decoder counts them
            counted = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
            if position_ids is None:
                position_ids = (torch.cumsum(counted, dim=1) * counted - 1).long()
            mask_positions = None
        masks = tuple(causal_lm.make_mask(kind, self.config, embeds, attention_mask, mask_positions) for kind in self.types)
        hidden = embeds
        if positions is not None:
            if getattr(self, "project_in", None) is not None:
                hidden = self.project_in(hidden)
            hidden = hidden + positions(counted, 0, position_ids=position_ids)
        for name in EMBEDDING_DROPOUTS:
            if hasattr(self, name):
                hidden = getattr(self, name)(hidden)
        for name in EMBEDDING_DROPOUT_RATES:
            rate = getattr(self._decoder[0], name, None)
            if isinstance(rate, (int, float)) and rate > 0:  # at 0 F.dropout draws nothing
                # In the decoder's mode, as its forward reads it, and off where the piece is put in eval mode
                # (an evaluation: the decoder is in no piece, so its own mode stays as the model's).
                training = self.training and self._decoder[0].training
                hidden = nn.functional.dropout(hidden, p=rate, training=training)
        rotary = self._rotary[0]
        # The model computes its tables from the hidden states as they enter the layers (only their dtype and
        # device matter); the rotary module moves its inv_freq to their device.
        tables = tuple(rotary(hidden, position_ids, *(() if kind is None else (kind,))) for kind in self.tables) \
            if rotary is not None else ()
        return hidden, Carried((masks, tables)), position_ids


class Layer(nn.Module):
    def __init__(self, layer, mask_index: int, table_index: int | None, layer_drop: float | None):
        super().__init__()
        self.layer = layer
        # layer_drop: None where the model draws no layer-drop number, else the chance a layer is skipped
        self.mask_index, self.table_index, self.layer_drop = mask_index, table_index, layer_drop

    def forward(self, inputs):
        hidden, carried, position_ids = inputs
        if self.training and self.layer_drop is not None and torch.rand([]) < self.layer_drop:  # OPT's layer drop
            return inputs
        masks, tables = carried.values
        extra = {} if self.table_index is None else {"position_embeddings": tables[self.table_index]}
        hidden = self.layer(hidden, attention_mask=masks[self.mask_index], position_ids=position_ids,
                            use_cache=False, **extra)
        return (hidden[0] if isinstance(hidden, tuple) else hidden), carried, position_ids


def layer_drop_draws(decoder, config) -> float | None:
    """The chance that training skips a layer where the decoder draws a random number for it before each layer
    (OPT's layer drop), None where it draws none. OPT in transformers 5.17 draws one per layer in training even at
    layerdrop 0, which moves the stream that dropout reads after it; later releases draw only when layerdrop > 0.
    The pieces draw as the installed release does, so dropout's masks stay the model's own."""
    rate = float(getattr(config, "layerdrop", 0.0) or 0.0)
    source = forward_source(decoder)
    if source is None:  # no source: it draws where it drops layers
        return rate if rate > 0 else None
    if "torch.rand([])" not in source:
        return None
    return rate if rate > 0 or "self.layerdrop > 0" not in source else None


def adapter(model):
    from hydra_torch.models.hf.adapter import Adapter

    config = model.config
    name = type(model).__name__
    if getattr(config, "output_router_logits", False):
        raise TypeError(f"not supported: {name} with output_router_logits=True (its auxiliary load-balancing loss): "
                        "set model.config.output_router_logits = False")
    if getattr(config, "use_bidirectional_attention", False):
        raise TypeError(f"not supported: {name} with use_bidirectional_attention=True (its masks are not causal)")
    parts = find_parts(model)
    kinds = layer_mask_types(parts.decoder, config)[:len(parts.layers)]
    types = tuple(dict.fromkeys(kinds))
    takes_type = parts.rotary is not None and "layer_type" in inspect.signature(parts.rotary.forward).parameters
    # One rotary table per layer type where the rotary module takes the type (Gemma 3), else one for all.
    tables = (types if takes_type else (None,)) if parts.rotary is not None else ()
    pieces = [Embeddings(parts, config, types, tables)]
    layer_drop = layer_drop_draws(parts.decoder, config)
    for layer, kind in zip(parts.layers, kinds):
        table = (tables.index(kind) if takes_type else 0) if tables else None
        pieces.append(Layer(layer, types.index(kind), table, layer_drop))
    softcap = getattr(config, "final_logit_softcapping", None)
    pieces.append(causal_lm.LMHead(parts.norm, parts.head, project_out=parts.extras.get("project_out"),
                                   softcap=softcap))
    learned = LEARNED_POSITIONS in parts.extras
    return Adapter(pieces, causal_lm.inputs, causal_lm.causal_lm_loss,
                   causal_lm.batch_checker(config.vocab_size,
                                           getattr(config, "max_position_embeddings", None) if learned else None,
                                           lowest_position=-1),  # OPT's own ids give padding -1
                   f"{name}: token embeddings, {len(parts.layers)} decoder layers, final norm + LM head",
                   fuse_head=pieces[-1].fuse)


def check_against_model(model, pieces, tokens: int = 16) -> None:
    """For a model of a family not in TESTED: its pieces' logits must equal its own forward's on a few tokens (no
    gradients), in eval mode and then in training mode from one seed (dropout draws alike where the pieces run the
    model's own work in its order), else TypeError before anything trains. A guard against a part the structure
    hid, or work its forward does in training alone, not a proof: a sliding window longer than `tokens` is not
    exercised."""
    ids = ((torch.arange(tokens) * 7 + 3) % model.config.vocab_size).unsqueeze(0)
    modes = {module: module.training for root in [model, *pieces] for module in root.modules()}
    try:
        for training in (False, True):
            model.train(training)
            for piece in pieces:
                piece.train(training)
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                expected = model(input_ids=ids, use_cache=False).logits.float()
                torch.manual_seed(0)
                x = (ids, None, None)
                for piece in pieces:
                    x = piece(x)
            _compare(model, x, expected, "in training mode" if training else "")
    finally:
        for module, training in modes.items():
            module.training = training


def _compare(model, x, expected: torch.Tensor, mode: str) -> None:
    name = type(model).__name__
    got = x.float() if isinstance(x, torch.Tensor) else None
    if got is None or got.shape != expected.shape:
        raise TypeError(f"not supported: {name}: its pieces give {type(x).__name__}, not its logits")
    tolerance = 1e-4 if next(model.parameters()).dtype == torch.float32 else 5e-2
    error = ((got - expected).abs().max() / expected.abs().max().clamp_min(1e-12)).item()
    if not error <= tolerance:
        raise TypeError(f"not supported: {name} (model_type {model.config.model_type!r}): run as pieces"
                        f"{' ' + mode if mode else ''}, its logits differ from its own forward's by {error:.2g} "
                        "(relative): its forward does something the decoder adapter does not know")
