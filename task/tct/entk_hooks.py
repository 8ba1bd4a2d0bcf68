"""The ``hooks`` method of the eNTK features (:mod:`task.tct.entk`): one batched forward and one
backward; forward hooks record each parameterised module's input and the gradient edge of its
output, and only the selected coordinates are formed from (input, grad_output) pairs: linear
layers as output-grad x input, convolutions as output-grad against ``unfold``ed inputs, GroupNorm
as output-grad x normalised input. Also the pieces every method shares: the first logit and the
selected coordinates of each parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.nn import functional as F

#: Elements of one block of products or gathered pairs in the hooks method (64 MiB of float32).
_GATHER_ELEMENTS = 1 << 24
#: Cost model of the hooks method, in units of one gathered (row, col) pair element: a
#: multiply-add inside ``bmm`` costs 1/_BLAS_GAIN, writing and gathering a dense entry
#: _DENSE_ENTRY (measured on CPU; only the choice of algorithm depends on them).
_BLAS_GAIN = 150.0
_DENSE_ENTRY = 0.4


def first_logit(output: Tensor) -> Tensor:
    """Column 0 of the (N, K) model output."""
    if output.ndim != 2:
        raise ValueError(f"entk_features: the model must output (N, K) logits, got {tuple(output.shape)}")
    return output[:, 0]


@dataclass(frozen=True)
class Selection:
    """The selected coordinates of one parameter."""

    positions: Tensor  # columns of the feature matrix
    local: Tensor  # flat indices inside the parameter


def parameter_selections(model: nn.Module, coords: Tensor, device: torch.device) -> dict[int, Selection]:
    """Map ``id(parameter)`` to its selected coordinates, for parameters holding any."""
    params = list(model.parameters())
    sizes = torch.tensor([p.numel() for p in params], dtype=torch.int64)
    ends = sizes.cumsum(0)
    owner = torch.searchsorted(ends, coords, right=True)
    selections = {}
    for k in owner.unique().tolist():
        positions = (owner == k).nonzero().squeeze(1)
        local = coords[positions] - (ends[k] - sizes[k])
        selections[id(params[k])] = Selection(positions.to(device), local.to(device))
    return selections


def hooks_features(model: nn.Module, x: Tensor, coords: Tensor) -> Tensor:
    """One forward, one backward to the parameterised modules' outputs, selected pairs only."""
    selections = parameter_selections(model, coords, x.device)
    modules = _hooked_modules(model, selections)
    records: list[tuple[nn.Module, Tensor, GradientEdge]] = []

    def record(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
        if output.requires_grad:
            records.append((module, inputs[0].detach(), get_gradient_edge(output)))

    handles = [m.register_forward_hook(record) for m in modules]
    try:
        logits = first_logit(model(x))
    finally:
        for handle in handles:
            handle.remove()
    grad_outputs = torch.autograd.grad(logits.sum(), [edge for *_, edge in records], allow_unused=True)
    feats = torch.zeros(len(coords), len(x), device=x.device)  # coordinate-major
    for (module, inp, _), g in zip(records, grad_outputs):
        if g is not None:
            _accumulate(feats, module, inp, g, selections)
    return feats.t()


def _hooked_modules(model: nn.Module, selections: dict[int, Selection]) -> list[nn.Module]:
    """Modules owning selected parameters; ValueError for a type the hooks cannot handle."""
    modules = []
    for name, m in model.named_modules():
        if not any(id(p) in selections for p in m.parameters(recurse=False)):
            continue
        if not isinstance(m, tuple(_HANDLERS)) or getattr(m, "groups", 1) != 1:
            raise ValueError(
                f"entk_features: method 'hooks' cannot handle module {name!r} ({type(m).__name__}), "
                "which owns selected coordinates; it supports Linear, Conv2d (groups=1) and "
                "GroupNorm. Use method='loop' (or 'vmap') instead"
            )
        modules.append(m)
    return modules


def _accumulate(
    feats: Tensor, module: nn.Module, inp: Tensor, g: Tensor, selections: dict[int, Selection]
) -> None:
    """Add one call's (k, N) contributions of ``module``'s selected coordinates to ``feats``."""
    chosen = {
        name: selections[id(p)]
        for name, p in module.named_parameters(recurse=False)
        if id(p) in selections
    }
    handler = next(h for cls, h in _HANDLERS.items() if isinstance(module, cls))
    local = {name: s.local for name, s in chosen.items()}
    for name, contribution in handler(module, inp, g, local).items():
        feats.index_add_(0, chosen[name].positions, contribution.to(feats.dtype))


def _products(g: Tensor, rows: Tensor, a: Tensor, cols: Tensor) -> Tensor:
    """(k, N): sum over the last dim of ``g[:, rows] * a[:, cols]``; g (N, O, L), a (N, K, L).

    These are entries (rows, cols) of the per-sample matrices ``g[n] @ a[n].T``: formed either
    densely with batched matmuls (fast, but every entry) or by gathering the selected pairs
    only, whichever the estimated cost favours.
    """
    dense_cost = g.shape[1] * a.shape[1] * (g.shape[2] / _BLAS_GAIN + _DENSE_ENTRY)
    if dense_cost < len(rows) * g.shape[2]:
        return _dense_products(g, rows, a, cols)
    return _pair_products(g, rows, a, cols)


def _dense_products(g: Tensor, rows: Tensor, a: Tensor, cols: Tensor) -> Tensor:
    """:func:`_products` via ``bmm`` over blocks of rows, then a gather of the selected entries."""
    n, num_rows, _ = g.shape
    width = a.shape[1]
    block = max(1, _GATHER_ELEMENTS // (n * width))
    order = torch.argsort(rows)
    starts = torch.arange(0, num_rows + block, block, device=rows.device)
    edges = torch.searchsorted(rows[order], starts).tolist()
    a_t = a.transpose(1, 2)
    out = torch.empty(len(rows), n, dtype=g.dtype, device=g.device)
    for lo, hi, first in zip(edges, edges[1:], range(0, num_rows, block)):
        if lo < hi:
            idx = order[lo:hi]
            block_products = torch.bmm(g[:, first : first + block], a_t).flatten(1)
            out[idx] = block_products[:, (rows[idx] - first) * width + cols[idx]].t()
    return out


def _pair_products(g: Tensor, rows: Tensor, a: Tensor, cols: Tensor) -> Tensor:
    """:func:`_products` by gathering the selected (row, col) pairs, chunked over pairs."""
    g = g.transpose(0, 1).contiguous()  # (O, N, L): whole rows gather contiguously
    a = a.transpose(0, 1).contiguous()
    chunk = max(1, _GATHER_ELEMENTS // (g.shape[1] * g.shape[2]))
    parts = [
        torch.einsum("knl,knl->kn", g.index_select(0, rows[s : s + chunk]), a.index_select(0, cols[s : s + chunk]))
        for s in range(0, len(rows), chunk)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _linear_grads(m: nn.Linear, inp: Tensor, g: Tensor, local: dict[str, Tensor]) -> dict[str, Tensor]:
    """weight (i, j): sum of grad_out[..., i] * input[..., j]; bias i: sum of grad_out[..., i]."""
    n = g.shape[0]
    g = g.reshape(n, -1, m.out_features).transpose(1, 2)
    out = {}
    if "weight" in local:
        a = inp.reshape(n, -1, m.in_features).transpose(1, 2)
        w = local["weight"]
        out["weight"] = _products(g, w // m.in_features, a, w % m.in_features)
    if "bias" in local:
        out["bias"] = g.sum(-1).t()[local["bias"]]
    return out


def _conv_patches(m: nn.Conv2d, inp: Tensor) -> Tensor:
    """The input patches the convolution multiplies, (N, C*kh*kw, L)."""
    padding = m.padding
    if m.padding_mode != "zeros" or isinstance(padding, str):
        mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
        inp = F.pad(inp, m._reversed_padding_repeated_twice, mode=mode)
        padding = 0
    return F.unfold(inp, m.kernel_size, dilation=m.dilation, padding=padding, stride=m.stride)


def _conv2d_grads(m: nn.Conv2d, inp: Tensor, g: Tensor, local: dict[str, Tensor]) -> dict[str, Tensor]:
    """weight (o, c, kh, kw): sum over positions of grad_out[o] * patch[c, kh, kw]; bias o."""
    g = g.flatten(2)
    out = {}
    if "weight" in local:
        w = local["weight"]
        patch = m.weight[0].numel()
        out["weight"] = _products(g, w // patch, _conv_patches(m, inp), w % patch)
    if "bias" in local:
        out["bias"] = g.sum(-1).t()[local["bias"]]
    return out


def _group_norm_grads(m: nn.GroupNorm, inp: Tensor, g: Tensor, local: dict[str, Tensor]) -> dict[str, Tensor]:
    """weight c: sum of grad_out[c] * normalised input[c]; bias c: sum of grad_out[c]."""
    n, c = g.shape[:2]
    out = {}
    if "weight" in local:
        normalised = F.group_norm(inp, m.num_groups, eps=m.eps)
        out["weight"] = (g * normalised).reshape(n, c, -1).sum(-1).t()[local["weight"]]
    if "bias" in local:
        out["bias"] = g.reshape(n, c, -1).sum(-1).t()[local["bias"]]
    return out


_HANDLERS: dict[type, Callable[..., dict[str, Tensor]]] = {
    nn.Linear: _linear_grads,
    nn.Conv2d: _conv2d_grads,
    nn.GroupNorm: _group_norm_grads,
}
