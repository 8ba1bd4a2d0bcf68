"""Empirical-NTK features for TCT (train-convexify-train, Yu et al. 2022).

Input x is represented by the gradient of a single output logit with respect to every
parameter of the network (flattened and concatenated in ``model.parameters()`` order), of
which only ``p`` fixed random coordinates are kept. :func:`entk_network` gives the network
with a fresh one-output head, :func:`select_coordinates` the coordinates, and
:func:`entk_features` / :func:`extract_features` the features.

Three interchangeable methods compute them:

* ``loop``: one sample at a time, the full gradient, then the coordinates (the reference).
* ``vmap``: ``torch.func.vmap(grad(...))`` over the batch (full per-sample gradients).
* ``hooks``: one batched forward and one backward; forward hooks record each parameterised
  module's input and the gradient edge of its output, and only the selected coordinates
  are formed from (input, grad_output) pairs. Supports ``nn.Linear``, ``nn.Conv2d``
  (groups=1) and ``nn.GroupNorm``; the backward stops at the recorded outputs, so no weight
  gradient is ever computed and no ``.grad`` is touched (:mod:`task.tct.entk_hooks`).

Per-sample gradients are independent only in eval mode (BatchNorm statistics and dropout
would mix or randomise them), and every module must see the sample index as dim 0.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from task.errors import ConfigError
from task.tct.entk_hooks import first_logit, hooks_features, parameter_selections

METHODS: tuple[str, ...] = ("hooks", "loop", "vmap")

#: Elements of the per-sample gradients held at once by the vmap method (256 MiB of float32).
_VMAP_ELEMENTS = 1 << 26

_TRAIN_SENSITIVE = (nn.modules.batchnorm._BatchNorm, nn.modules.dropout._DropoutNd)


def entk_network(model: nn.Module, seed: int) -> nn.Module:
    """A deep copy of ``model`` whose last ``nn.Linear`` has one output, seeded; in eval mode.

    The new layer keeps ``in_features``, bias presence, device and dtype, and gets PyTorch's
    default initialisation drawn from an explicit generator seeded with ``seed`` (the global
    RNG is not used).
    """
    net = copy.deepcopy(model)
    linears = [name for name, m in net.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError(f"entk_network: {type(model).__name__} has no nn.Linear to re-initialise")
    old = net.get_submodule(linears[-1])
    head = _seeded_linear(old.in_features, old.bias is not None, seed)
    net.set_submodule(linears[-1], head.to(device=old.weight.device, dtype=old.weight.dtype))
    return net.eval()


def entk_setup(model: nn.Module, p: int, seed: int) -> tuple[nn.Module, Tensor]:
    """The eNTK network (last layer re-initialised to one logit) and its ``p`` coordinates, both
    from the run ``seed``: identical on every node and on the server."""
    net = entk_network(model, seed=seed)
    return net, select_coordinates(parameter_count(net), p, seed)


def _seeded_linear(in_features: int, bias: bool, seed: int) -> nn.Linear:
    """``nn.Linear(in_features, 1)`` with ``reset_parameters``' init drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    layer = nn.utils.skip_init(nn.Linear, in_features, 1, bias=bias)
    nn.init.kaiming_uniform_(layer.weight, a=math.sqrt(5), generator=gen)
    if layer.bias is not None:
        bound = 1 / math.sqrt(in_features) if in_features > 0 else 0.0
        nn.init.uniform_(layer.bias, -bound, bound, generator=gen)
    return layer


def parameter_count(model: nn.Module) -> int:
    """Number of scalar parameters (shared parameters counted once)."""
    return sum(p.numel() for p in model.parameters())


def select_coordinates(num_params: int, p: int, seed: int) -> Tensor:
    """``p`` distinct sorted int64 coordinates in ``[0, num_params)``, a function of ``seed``."""
    if not 1 <= p <= num_params:
        raise ConfigError(
            f"tct.features: the number of eNTK coordinates must be in [1, {num_params}] "
            f"(the network's parameter count), got {p}"
        )
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(num_params, generator=gen)[:p].sort().values


def entk_features(model: nn.Module, x: Tensor, coords: Tensor, method: str = "hooks") -> Tensor:
    """(N, p) float32 on x's device: d model(x[n:n+1])[0, 0] / d theta at ``coords``, per row n."""
    compute = _method(method)
    _check_eval(model)
    coords = _check_coords(coords, parameter_count(model))
    if len(x) == 0:
        return torch.zeros(0, len(coords), device=x.device)
    with torch.enable_grad(), _all_requiring_grad(model), _full_float32(x.device):
        return compute(model, x, coords).float()


@contextmanager
def _full_float32(device: torch.device) -> Iterator[None]:
    """Float32 arithmetic whatever the caller set: no autocast (a client's ``train.precision``)
    and no TF32 on CUDA (cuDNN's default for convolutions), so that every method computes the
    same features up to float32 rounding."""
    matmul = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.autocast(device_type=device.type, enabled=False), torch.backends.cudnn.flags(
                enabled=torch.backends.cudnn.enabled, benchmark=torch.backends.cudnn.benchmark,
                deterministic=torch.backends.cudnn.deterministic, allow_tf32=False):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul


def extract_features(
    model: nn.Module,
    x: Tensor,
    coords: Tensor,
    out: Tensor,
    method: str = "hooks",
    batch_size: int = 256,
) -> None:
    """Fill ``out`` (N, p) with the features of ``x``, ``batch_size`` samples at a time.

    Each batch of ``x`` is moved to the model's device, and its float32 features are cast
    to ``out.dtype`` and copied into ``out`` (on any device; a memmap view works).
    """
    _method(method)
    if batch_size < 1:
        raise ValueError(f"extract_features: batch_size must be >= 1, got {batch_size}")
    if tuple(out.shape) != (len(x), len(coords)):
        raise ValueError(
            f"extract_features: out has shape {tuple(out.shape)}, expected {(len(x), len(coords))}"
        )
    device = next(model.parameters()).device
    for start in range(0, len(x), batch_size):
        batch = x[start : start + batch_size].to(device)
        out[start : start + len(batch)].copy_(entk_features(model, batch, coords, method))


def _method(method: str) -> Callable[[nn.Module, Tensor, Tensor], Tensor]:
    if method not in _COMPUTE:
        raise ConfigError(f"tct.entk_method: unknown method {method!r}; allowed: {list(METHODS)}")
    return _COMPUTE[method]


def _check_eval(model: nn.Module) -> None:
    """Raise ValueError if a BatchNorm or Dropout module is in training mode."""
    for name, m in model.named_modules():
        if m.training and isinstance(m, _TRAIN_SENSITIVE):
            raise ValueError(
                f"entk_features: module {name!r} ({type(m).__name__}) is in training mode, so "
                "per-sample gradients are not independent; call model.eval() first"
            )


def _check_coords(coords: Tensor, num_params: int) -> Tensor:
    """``coords`` as a 1-D int64 CPU tensor inside ``[0, num_params)``."""
    if coords.ndim != 1 or coords.dtype.is_floating_point or coords.dtype.is_complex:
        raise ValueError(f"coords must be a 1-D integer tensor, got {coords.dtype} {tuple(coords.shape)}")
    coords = coords.to("cpu", torch.int64)
    if len(coords) and (int(coords.min()) < 0 or int(coords.max()) >= num_params):
        raise ValueError(f"coords must lie in [0, {num_params}) (the model's parameter count)")
    return coords


@contextmanager
def _all_requiring_grad(model: nn.Module) -> Iterator[None]:
    """Temporarily let every parameter require grad (frozen ones still have eNTK coordinates)."""
    frozen = [p for p in model.parameters() if not p.requires_grad]
    for p in frozen:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(False)


def _loop_features(model: nn.Module, x: Tensor, coords: Tensor) -> Tensor:
    """The reference: per sample, the full gradient concatenated, then indexed."""
    params = list(model.parameters())
    coords = coords.to(x.device)
    rows = []
    for n in range(len(x)):
        logit = first_logit(model(x[n : n + 1]))[0]
        grads = torch.autograd.grad(logit, params, allow_unused=True)
        flat = torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(grads, params)])
        rows.append(flat[coords].float())
    return torch.stack(rows)


def _vmap_features(model: nn.Module, x: Tensor, coords: Tensor) -> Tensor:
    """``vmap(grad(...))`` over chunks of the batch, differentiating the selected parameters."""
    selections = parameter_selections(model, coords, x.device)
    named = dict(model.named_parameters())
    params = {name: p.detach() for name, p in named.items() if id(p) in selections}
    fixed = {name: p.detach() for name, p in named.items() if name not in params}

    def logit(theta: dict[str, Tensor], sample: Tensor) -> Tensor:
        return first_logit(functional_call(model, {**fixed, **theta}, (sample.unsqueeze(0),)))[0]

    per_sample = vmap(grad(logit), in_dims=(None, 0))
    feats = torch.zeros(len(x), len(coords), device=x.device)
    chunk = max(1, _VMAP_ELEMENTS // sum(p.numel() for p in params.values()))
    for start in range(0, len(x), chunk):
        grads = per_sample(params, x[start : start + chunk])
        rows = slice(start, start + chunk)
        for name, g in grads.items():
            s = selections[id(named[name])]
            feats[rows, s.positions] = g.flatten(1)[:, s.local].float()
    return feats


_COMPUTE: dict[str, Callable[[nn.Module, Tensor, Tensor], Tensor]] = {
    "hooks": hooks_features,
    "loop": _loop_features,
    "vmap": _vmap_features,
}
