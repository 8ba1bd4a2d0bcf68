"""A model as a sequence of named layer groups (:class:`SplitModel`), and its softmax output layer.

A :class:`SplitModel` is an ``nn.Sequential`` whose entries are *layer groups* (``conv1``,
``fc3``, ``layer4`` ...), so parameter names are ``"<group>.<...>"`` and algorithms choose
the shared body and the personal head by group name, never by position. Flattening always
happens inside a group, so any suffix of the groups can serve as the head. The models
themselves are built in :mod:`task.learning.models`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

from task.errors import ConfigError


class SplitModel(nn.Sequential):
    """An ``nn.Sequential`` of named layer groups that can be split into body and head."""

    def __init__(self, groups: OrderedDict[str, nn.Module], default_head: Sequence[str] = ()):
        """Build from ordered ``groups``; ``default_head`` defaults to the last group."""
        super().__init__(groups)
        self.default_head: tuple[str, ...] = tuple(default_head) or (self.group_names[-1],)
        self.split_at(self.default_head, key="default_head")

    @property
    def group_names(self) -> list[str]:
        """The group names, in forward order."""
        return [name for name in self._modules if name not in self.branches]

    #: Submodules that are not layer groups (not on the forward path), e.g. an adversary.
    branches: tuple[str, ...] = ()

    def _group_modules(self) -> list[nn.Module]:
        return [self._modules[name] for name in self.group_names]

    def forward(self, x: Tensor) -> Tensor:
        """Run every layer group in order."""
        for module in self._group_modules():
            x = module(x)
        return x

    def check_groups(self, groups: Iterable[str], key: str) -> None:
        """Raise ConfigError naming ``key`` if any of ``groups`` is not a group of this model.

        A single string counts as one group name.
        """
        names = self.group_names
        unknown = [g for g in _as_list(groups) if g not in names]
        if unknown:
            raise ConfigError(f"{key}: unknown layer group(s) {unknown}; allowed groups: {names}")

    def parameter_names(self, groups: Iterable[str]) -> list[str]:
        """State-dict keys (parameters and buffers) of ``groups``, in state-dict order."""
        wanted = _as_list(groups)
        self.check_groups(wanted, key="groups")
        return [k for k in self.state_dict() if k.split(".", 1)[0] in wanted]

    def split_at(self, head: Sequence[str], key: str = "model.head") -> int:
        """Index of the first head group; ``head`` must be a non-empty suffix of the groups."""
        head = _as_list(head)
        self.check_groups(head, key)
        names = self.group_names
        if not head or head != names[len(names) - len(head) :]:
            suffixes = [names[i:] for i in range(len(names) - 1, -1, -1)]
            raise ConfigError(
                f"{key}: head {head} must be a non-empty suffix of the layer groups {names}; "
                f"allowed: {suffixes}"
            )
        return len(names) - len(head)

    def features(self, x: Tensor, head: Sequence[str]) -> Tensor:
        """Run the body (every group before ``head``) on ``x``."""
        for module in self._group_modules()[: self.split_at(head)]:
            x = module(x)
        return x

    def head_forward(self, z: Tensor, head: Sequence[str]) -> Tensor:
        """Run the ``head`` groups on body features ``z``."""
        for module in self._group_modules()[self.split_at(head) :]:
            z = module(z)
        return z


class SoftmaxLinear(nn.Linear):
    """A linear layer whose output is ``softmax(dim=1)`` of its logits: the official MLPs' output
    layer (``model.output=softmax``). Same parameters and state-dict keys as ``nn.Linear``."""

    def forward(self, x: Tensor) -> Tensor:
        """Class probabilities."""
        return torch.softmax(super().forward(x), dim=1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, softmax over dim 1"


def softmax_output(model: SplitModel) -> SplitModel:
    """Replace the output layer (the last group, or its last module, an ``nn.Linear``) by a
    :class:`SoftmaxLinear` with the same weights (no random numbers drawn)."""
    path = model.group_names[-1]
    if isinstance(model.get_submodule(path), nn.Sequential):
        path = f"{path}.{len(model.get_submodule(path)) - 1}"
    last = model.get_submodule(path)
    if type(last) is not nn.Linear:
        raise ConfigError(f"model.output: 'softmax' needs a linear output layer; {path} is {type(last).__name__}")
    new = nn.utils.skip_init(SoftmaxLinear, last.in_features, last.out_features, bias=last.bias is not None,
                             device=last.weight.device, dtype=last.weight.dtype)
    new.load_state_dict(last.state_dict())
    model.set_submodule(path, new)
    return model


def _as_list(groups: Iterable[str]) -> list[str]:
    return [groups] if isinstance(groups, str) else list(groups)
