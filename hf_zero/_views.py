"""Bucket views as savers see them: a module's ``state_dict()`` hands out tensors with storage of their own.

[Note: views in a state dict]
With ``parameters_as_bucket_view`` the trainable params of a bound model are views of a few flat
buffers. Savers that refuse tensors sharing a storage (safetensors' ``save_model`` / ``save_file``:
"no suitable name to keep"), or that drop all but one of them (Accelerate's ``save_model`` /
``save_state``), or that clone each one (transformers' ``save_pretrained``), would fail, lose
weights or copy the model. So while an optimizer is bound, the module's state-dict post-hook gives
every such view a storage object of its own over the same memory (``torch.from_dlpack``: no copy),
as DDP's state dicts are plain tensors; after the run the params own their storage again
([Note: params own their storage after a run] in _partition.py) and the hook is gone.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from ._binding import Binding, Hook
from ._masters import watch_alias


def own_storage(state_dict: dict) -> dict[str, torch.Tensor]:
    """Give every tensor that shares storage with a *different* tensor a storage object of
    its own, over the same memory (``torch.from_dlpack``: no copy; savers that refuse or
    copy shared storage, as safetensors and transformers' ``save_pretrained`` do, see
    separate tensors). Returns the entries replaced (name -> alias).

    Exact aliases (tied weights: same data, shape and strides) stay aliases of one
    tensor, so Accelerate still drops the duplicates it is meant to drop.
    """
    by_storage: dict[tuple, list[str]] = defaultdict(list)
    for name, t in state_dict.items():
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            by_storage[(t.device, t.untyped_storage().data_ptr())].append(name)
    replaced = {}
    for names in by_storage.values():
        if len(names) < 2:
            continue
        copies: dict[tuple, torch.Tensor] = {}
        for name in names:
            t = state_dict[name]
            key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
            if key not in copies:
                copies[key] = torch.from_dlpack(t.detach())
            state_dict[name] = replaced[name] = copies[key]
    return replaced


def own_storage_watched(state_dict: dict, module: torch.nn.Module, prefix: str = "") -> None:
    """:func:`own_storage`, and the masters of ``module``'s params (named ``prefix`` + their name in
    ``state_dict``) follow writes through the aliases it hands out ([Note: writes through a state
    dict's aliases] in _masters.py)."""
    replaced = own_storage(state_dict)
    if replaced:
        params = {prefix + n: p for n, p in module.named_parameters(remove_duplicate=False)}
        for name, alias in replaced.items():
            if name in params:
                watch_alias(alias, params[name])


class _OwnStorage(Hook):
    """The model's state-dict post-hook of :func:`separate_views` (no ``__slots__``: torch marks the hooks
    it is given with an attribute)."""

    def __call__(self, module, state_dict, prefix, local_metadata) -> None:
        own_storage_watched(state_dict, module, prefix)


def separate_views(module: torch.nn.Module, binding: Binding) -> None:
    """Make ``module.state_dict()`` give bucket views storage objects of their own (see
    [Note: views in a state dict]) until ``binding`` closes. Idempotent."""
    binding.once(module, "own_storage", lambda: module.register_state_dict_post_hook(_OwnStorage()))
