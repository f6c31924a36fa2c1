"""A batch moved to a device: its tensors, wherever they sit in tuples, lists, dicts and other mappings."""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.utils._pytree import SUPPORTED_NODES, tree_map


def _foreign_mapping(node) -> bool:
    """A mapping pytree does not open (it would pass it by as a leaf, its tensors unmoved): a tokenizer's or data
    collator's transformers.BatchEncoding (a UserDict), say."""
    return isinstance(node, Mapping) and type(node) not in SUPPORTED_NODES


def _rebuilt(mapping, items: dict):
    try:
        return type(mapping)(items)  # as transformers.Trainer moves its inputs: BatchEncoding(dict), UserDict(dict)
    except TypeError:  # a mapping not built from a dict: its items as a dict
        return items


def to_device(tree, device, non_blocking: bool = True):
    def move(node):
        if isinstance(node, torch.Tensor):
            return node.to(device, non_blocking=non_blocking)
        if _foreign_mapping(node):
            return _rebuilt(node, {key: to_device(value, device, non_blocking) for key, value in node.items()})
        return node

    return tree_map(move, tree, is_leaf=_foreign_mapping)
