"""Representation measurements of trained networks (FedAvg-FT §5.2, Figures 2, 4 and 5).

* Figure 4: the mean cosine similarity between the features of test samples of two classes
  (:func:`class_cosine_matrix`).
* Figure 2: linear CKA (Kornblith et al., 2019) between the activations of the same layers of two
  models, e.g. a pre-trained model and its fine-tuned copy (:func:`cka_by_layer`).
* Figure 5: test accuracy of new clients after fine-tuning a trained model with a given number of
  samples per epoch (:func:`fine_tune_transfer`).

Plain numpy/torch/matplotlib; nothing here knows about Flower.
"""

from __future__ import annotations

import contextlib
import csv
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

Array = np.ndarray | Tensor

# ---------------------------------------------------------------- cosine similarity (Figure 4)


def class_cosine_matrix(features: Array, labels: Array, num_classes: int) -> np.ndarray:
    """C × C matrix whose (i, j) entry is the mean cosine similarity between the features of
    class i and of class j, over all pairs (pairs of distinct samples when i == j).

    Computed from class sums S_i of the normalised rows, never the N × N matrix:
    off-diagonal S_i·S_j / (n_i n_j), diagonal (|S_i|² − Σ_k |u_k|²) / (n_i (n_i − 1)).
    A zero-norm feature row counts as a zero vector: its cosine with any other sample is 0 and it
    still counts in n_i. An entry is NaN where a class has no sample (its row and column) or,
    on the diagonal, fewer than two.
    """
    feats = torch.as_tensor(features).flatten(1).double().cpu()
    labels = torch.as_tensor(labels).long().cpu()
    norms = feats.norm(dim=1, keepdim=True)
    units = feats / torch.where(norms > 0, norms, torch.ones_like(norms))
    sums = torch.zeros(num_classes, units.shape[1], dtype=torch.float64).index_add_(0, labels, units)
    counts = torch.bincount(labels, minlength=num_classes).double()
    self_terms = torch.zeros(num_classes, dtype=torch.float64).index_add_(0, labels, (units**2).sum(1))
    with np.errstate(divide="ignore", invalid="ignore"):
        matrix = (sums @ sums.T).numpy() / np.outer(counts, counts)
        diag = ((sums**2).sum(1) - self_terms).numpy() / (counts * (counts - 1)).numpy()
    np.fill_diagonal(matrix, np.where(counts.numpy() >= 2, diag, np.nan))
    matrix[counts.numpy() == 0, :] = np.nan
    matrix[:, counts.numpy() == 0] = np.nan
    return matrix


def _nanmean(values: np.ndarray) -> float:
    finite = values[~np.isnan(values)]
    return float(finite.mean()) if finite.size else float("nan")


def cosine_summary(matrix: np.ndarray) -> dict[str, float]:
    """Mean of the diagonal (intra-class) and of the off-diagonal (inter-class) entries, NaNs left out."""
    off = ~np.eye(matrix.shape[0], dtype=bool)
    return {"mean_diagonal": _nanmean(np.diag(matrix)), "mean_off_diagonal": _nanmean(matrix[off])}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_cosine(matrix: np.ndarray, class_names: Sequence[str], path_png: str | Path, path_csv: str | Path,
                 title: str) -> None:
    """Write the matrix as a heatmap PNG (cells annotated when C ≤ 20) and as a CSV with class names."""
    names = [str(n) for n in class_names]
    Path(path_csv).parent.mkdir(parents=True, exist_ok=True)
    with Path(path_csv).open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["class", *names])
        writer.writerows([name, *(f"{v:.6g}" for v in row)] for name, row in zip(names, matrix))
    plt = _pyplot()
    size = min(2 + 0.5 * len(names), 12)
    fig, ax = plt.subplots(figsize=(size + 1, size))
    image = ax.imshow(matrix, cmap="RdBu_r", vmin=-1, vmax=1)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    ax.set_xticks(range(len(names)), names, rotation=90)
    ax.set_yticks(range(len(names)), names)
    if len(names) <= 20:
        for (i, j), v in np.ndenumerate(matrix):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7, color="w" if abs(v) > 0.6 else "k")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    Path(path_png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path_png, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- CKA (Figure 2)


def plot_cosine_grid(matrices: dict[str, np.ndarray], path: str | Path) -> None:
    """Several models' cosine matrices side by side on one colour scale (-1 to 1), titled with
    each label and its mean diagonal / off-diagonal."""
    plt = _pyplot()
    n = max(len(matrices), 1)
    fig, axes = plt.subplots(1, n, figsize=(3.2 * n + 0.8, 3.4), squeeze=False)
    image = None
    for ax, (label, matrix) in zip(axes[0], matrices.items()):
        image = ax.imshow(matrix, cmap="RdBu_r", vmin=-1, vmax=1)
        summary = cosine_summary(matrix)
        ax.set_title(f"{label}\ndiag {summary['mean_diagonal']:.2f}, off {summary['mean_off_diagonal']:.2f}", fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    if image is not None:
        fig.colorbar(image, ax=list(axes[0]), shrink=0.8)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _centred(x: Array) -> Tensor:
    x = torch.as_tensor(x).flatten(1).double()
    return x - x.mean(0, keepdim=True)


def linear_cka(x: Array, y: Array) -> float:
    """Full-sample linear CKA of activations x (N × D1) and y (N × D2), in float64.

    The estimator of Kornblith et al. (2019) from column-centred features:
    ‖YᵀX‖²_F / (‖XᵀX‖_F ‖YᵀY‖_F), i.e. the *biased* HSIC estimator tr(KHLH)/(n−1)² normalised.
    With fewer samples than features the equal form ⟨XXᵀ, YYᵀ⟩_F / (‖XXᵀ‖_F ‖YYᵀ‖_F) is used.
    NaN if either input has zero variance.
    """
    x, y = _centred(x), _centred(y)
    if x.shape[0] < max(x.shape[1], y.shape[1]):
        kx, ky = x @ x.T, y @ y.T
        return float((kx * ky).sum() / (kx.norm() * ky.norm()))
    return float((y.T @ x).norm() ** 2 / ((x.T @ x).norm() * (y.T @ y).norm()))


def _zero_diagonal_grams(acts: Sequence[Tensor]) -> Tensor:
    """Linear-kernel Gram matrices (layers × n × n, float64) of centred activations, zero diagonal."""
    centred = [_centred(a) for a in acts]
    grams = torch.stack([c @ c.T for c in centred])
    return grams * (1 - torch.eye(grams.shape[-1], dtype=grams.dtype, device=grams.device))


def _unbiased_hsic(ga: Tensor, gb: Tensor) -> Tensor:
    """Unbiased HSIC of every pair of zero-diagonal Grams (K × n × n, L × n × n) -> K × L (Song et al., 2012)."""
    n = ga.shape[-1]
    ra, rb = ga.sum(-1), gb.sum(-1)
    trace = torch.einsum("kij,lij->kl", ga, gb)
    sums = torch.outer(ra.sum(-1), rb.sum(-1)) / ((n - 1) * (n - 2))
    return (trace + sums - 2.0 / (n - 2) * ra @ rb.T) / (n * (n - 3))


class CKAAccumulator:
    """Minibatch linear CKA of K layers (side a) against L layers (side b), as in Nguyen, Raghu &
    Kornblith (2021): the *unbiased* HSIC estimator of Song et al. (2012) is averaged over
    minibatches, and CKA = mean HSIC(a, b) / sqrt(mean HSIC(a, a) · mean HSIC(b, b)).

    This is an estimate of the population CKA that depends on the batch size (and differs from
    :func:`linear_cka`, the biased full-sample estimator); it needs only one minibatch of
    activations in memory. Every minibatch needs at least 4 samples.
    """

    def __init__(self) -> None:
        self._ab: Tensor | None = None
        self._aa: Tensor | None = None
        self._bb: Tensor | None = None

    def update(self, acts_a: Sequence[Tensor], acts_b: Sequence[Tensor]) -> None:
        """Add one minibatch: K activations (n × ...) of side a and L of side b, on the same n samples."""
        n = acts_a[0].shape[0]
        if n < 4 or any(a.shape[0] != n for a in [*acts_a, *acts_b]):
            raise ValueError(f"CKA minibatches need the same n >= 4 samples on every layer, got "
                             f"{[a.shape[0] for a in [*acts_a, *acts_b]]}")
        ga, gb = _zero_diagonal_grams(acts_a), _zero_diagonal_grams(acts_b)
        ab = _unbiased_hsic(ga, gb)
        aa, bb = torch.diagonal(_unbiased_hsic(ga, ga)), torch.diagonal(_unbiased_hsic(gb, gb))
        if self._ab is None:
            self._ab, self._aa, self._bb = ab, aa, bb
        else:
            self._ab, self._aa, self._bb = self._ab + ab, self._aa + aa, self._bb + bb

    def result(self) -> np.ndarray:
        """K × L minibatch CKA of every (a, b) pair of layers."""
        if self._ab is None:
            raise ValueError("CKAAccumulator.result: no minibatch was added")
        return (self._ab / torch.sqrt(torch.outer(self._aa, self._bb))).cpu().numpy()


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode inside the block; every module's own train/eval flag restored afterwards."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _chunk_activations(model: nn.Module, x: Tensor, layer_names: Sequence[str]) -> list[Tensor]:
    """Flattened float32 outputs of the named modules on one chunk ``x`` (eval mode, no grad)."""
    store: dict[str, Tensor] = {}

    def hook(name: str):
        return lambda _module, _inputs, out: store.__setitem__(name, out.detach().flatten(1).float())

    handles = [model.get_submodule(name).register_forward_hook(hook(name)) for name in layer_names]
    try:
        with _eval_mode(model), torch.no_grad():
            model(x.to(next(model.parameters(), x).device))
    finally:
        for handle in handles:
            handle.remove()
    return [store[name] for name in layer_names]


def _chunks(x: Tensor, batch_size: int) -> Iterator[Tensor]:
    for start in range(0, x.shape[0], batch_size):
        yield x[start : start + batch_size]


def layer_activations(model: nn.Module, x: Tensor, layer_names: Sequence[str],
                      batch_size: int) -> dict[str, Tensor]:
    """Flattened float32 outputs (N × D, on the CPU) of the modules named ``layer_names``
    (``model.named_modules()`` names), computed in eval mode under no_grad in chunks of ``batch_size``.
    The model's train/eval flags are left as they were."""
    chunks = [[a.cpu() for a in _chunk_activations(model, xb, layer_names)] for xb in _chunks(x, batch_size)]
    return {name: torch.cat([c[i] for c in chunks]) for i, name in enumerate(layer_names)}


def cka_by_layer(model_a: nn.Module, model_b: nn.Module, x: Tensor, layer_names: Sequence[str],
                 batch_size: int, minibatch: bool) -> list[float]:
    """CKA between the same-named layers of two models on inputs ``x``, per layer.

    ``minibatch=False``: full-sample :func:`linear_cka` (all activations in memory);
    ``minibatch=True``: :class:`CKAAccumulator` over chunks of ``batch_size`` (each chunk, the last
    included, needs at least 4 samples).
    """
    if not minibatch:
        acts_a = layer_activations(model_a, x, layer_names, batch_size)
        acts_b = layer_activations(model_b, x, layer_names, batch_size)
        return [linear_cka(acts_a[name], acts_b[name]) for name in layer_names]
    acc = CKAAccumulator()
    for xb in _chunks(x, batch_size):
        acc.update(_chunk_activations(model_a, xb, layer_names), _chunk_activations(model_b, xb, layer_names))
    return [float(v) for v in np.diag(acc.result())]


def plot_cka_by_layer(results: dict[str, Sequence[float]], layer_names: Sequence[str], path: str | Path,
                      title: str) -> None:
    """CKA per layer, one line per label (e.g. one per algorithm)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(4.5, 0.6 * len(layer_names)), 3.5))
    for label, values in results.items():
        ax.plot(range(len(layer_names)), values, "o-", ms=4, label=label)
    ax.set_xticks(range(len(layer_names)), layer_names, rotation=45, ha="right")
    ax.set(ylim=(0, 1.05), xlabel="layer", ylabel="CKA", title=title)
    _save_lines(plt, fig, ax, path)


# ---------------------------------------------------------------- fine-tuning transfer (Figure 5)

Client = tuple[Tensor, Tensor, Tensor, Tensor]


def _head_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The head's parameters: a SplitModel's ``default_head`` groups, else the last child module's."""
    heads = getattr(model, "default_head", None)
    modules = [model.get_submodule(g) for g in heads] if heads else [list(model.children())[-1]]
    return [p for m in modules for p in m.parameters()]


def _accuracy(model: nn.Module, x: Tensor, y: Tensor, batch_size: int) -> float:
    with _eval_mode(model), torch.no_grad():
        correct = sum(int((model(x[s : s + batch_size]).argmax(1) == y[s : s + batch_size]).sum())
                      for s in range(0, x.shape[0], batch_size))
    return correct / max(int(y.shape[0]), 1)


def fine_tune(model: nn.Module, client: Client, epochs: int, samples: int, lr: float, batch_size: int,
                    generator: torch.Generator, train_head_only: bool) -> float:
    """Fine-tune ``model`` in place on ``samples`` fresh draws per epoch; return its test accuracy."""
    x_train, y_train, x_test, y_test = client
    if samples > x_train.shape[0]:
        raise ValueError(f"fine_tune_transfer: {samples} samples per epoch, the client has {x_train.shape[0]}")
    params = _head_parameters(model) if train_head_only else list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=lr)
    model.train()
    for _ in range(epochs):
        drawn = torch.randperm(x_train.shape[0], generator=generator)[:samples].to(x_train.device)
        for start in range(0, samples, batch_size):
            idx = drawn[start : start + batch_size]
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x_train[idx]), y_train[idx]).backward()
            optimizer.step()
    return _accuracy(model, x_test, y_test, batch_size)


def fine_tune_transfer(build_model: Callable[[], nn.Module], state: dict, clients: Sequence[Client], epochs: int,
                       samples_per_epoch: Sequence[int], trials: int, lr: float, batch_size: int, seed: int,
                       train_head_only: bool = False,
                       new_head: Callable[[nn.Module], None] | None = None) -> dict:
    """Test accuracy of new clients after fine-tuning ``state`` (FedAvg-FT Figure 5).

    For each s in ``samples_per_epoch``, trial and client (x_train, y_train, x_test, y_test): a fresh
    ``build_model()`` loads ``state``, ``new_head(model)`` (if given) replaces or re-initialises its
    head in place (new classes), then ``epochs`` epochs of plain SGD (``lr``, cross-entropy, batches
    of ``batch_size``) each draw s distinct training samples; the model is then scored on the test
    split. ``train_head_only`` updates only the head (:func:`_head_parameters`); the body still runs
    in train mode. Randomness (the draws and ``new_head``'s initialisation) comes from seeds of
    (seed, trial, client), the same for every s. Runs on the device of the client's tensors.

    Returns ``samples_per_epoch``, ``mean`` and ``std`` (population std over trials × clients) per
    s, and ``accuracies`` (per s, the trials × clients values, trial-major).
    """
    accuracies: list[list[float]] = []
    for samples in samples_per_epoch:
        values = []
        for trial in range(trials):
            for index, client in enumerate(clients):
                run_seed = int(np.random.SeedSequence([seed, trial, index]).generate_state(1)[0])
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(run_seed)
                    model = build_model()
                    model.load_state_dict(state)
                    if new_head is not None:
                        new_head(model)
                generator = torch.Generator().manual_seed(run_seed)
                values.append(fine_tune(model.to(client[0].device), client, epochs, int(samples), lr,
                                              batch_size, generator, train_head_only))
        accuracies.append(values)
    return {"samples_per_epoch": [int(s) for s in samples_per_epoch],
            "mean": [float(np.mean(v)) for v in accuracies],
            "std": [float(np.std(v)) for v in accuracies],
            "accuracies": accuracies}


def plot_transfer(curves: dict[str, dict], path: str | Path, title: str) -> None:
    """Accuracy against samples per epoch with ±std error bars, one line per label
    (each value a :func:`fine_tune_transfer` result)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for label, res in curves.items():
        ax.errorbar(res["samples_per_epoch"], res["mean"], yerr=res["std"], marker="o", ms=4, capsize=3,
                    label=label)
    ax.set(xlabel="samples per epoch", ylabel="test accuracy", title=title)
    _save_lines(plt, fig, ax, path)


def _save_lines(plt, fig, ax, path: str | Path) -> None:
    """Finish a line plot (small title, grid, legend) and write it to ``path``."""
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
