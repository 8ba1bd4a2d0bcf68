"""``flrep diagnose``: how good a run's learned representation is, beyond accuracy ("FedAvg with
fine tuning", Collins et al. 2022, Section 5.2), for any run of any algorithm:

- ``cosine``: the classes × classes mean cosine similarity of body features of the run's test
  images (Figure 4), a heatmap and CSV per model and one figure with every model;
- ``cka``: each model fine-tuned on new clients, then linear CKA per layer group between the
  model before and after (Figure 2; averaged over the new clients), one figure for all models;
- ``transfer``: new clients' test accuracy after fine-tuning for E epochs with a varying number
  of samples per epoch, mean ± std over trials and clients (Figure 5), one figure.

A model is a run directory (its last server checkpoint, see :mod:`flower_app.tools.export`) or an
exported ``model.pt``. New clients come from an experiment configuration: its held-out new
clients (``data.num_new_clients``, with ``data.new_client_classes`` for unseen classes) when it
has them, else its first clients (another dataset). The analyses are ``task.analysis.representation``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from task.analysis import representation as rep
from task.errors import ConfigError
from task.learning.engine import TensorData


def open_model(path: Path) -> tuple[torch.nn.Module, dict]:
    """The model of a run directory or ``model.pt``, in eval mode, and its description."""
    from flower_app.tools.export import load_model, model_from_run

    path = Path(path).expanduser().resolve()
    if path.is_dir():
        model, saved = model_from_run(path)
        return model.eval(), saved
    if path.is_file():
        return load_model(path)
    raise ConfigError(f"{path}: neither a run directory nor a model file")


def open_models(paths: Sequence[Path]) -> list[tuple[Path, torch.nn.Module, dict]]:
    """Every model of ``paths`` (path, model, description), all opened before anything is written."""
    return [(path, *open_model(path)) for path in paths]


def _name(saved: dict) -> str:
    run = saved["run"]
    return f"{run['label']} ({Path(run['dir']).name})"


def test_split(saved: dict) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """The inputs, labels and class names of the model's run's test set."""
    from task.data.federated_data import build_federated_data

    data = build_federated_data(OmegaConf.create(saved["data"]), int(saved["run"]["seed"]))
    test = TensorData.from_arrays(data.bundle.test.x, data.bundle.test.y, torch.device("cpu"))
    names = [str(c) for c in data.bundle.meta.get("class_names") or range(data.bundle.num_classes)]
    return test.x.float(), test.y.long(), names


def new_clients(experiment: str, overrides: Sequence[str], count: int) -> list[rep.Client]:
    """Up to ``count`` new clients (train x, y, test x, y) of ``experiment``'s data."""
    from flower_app.run.config import load_config
    from task.data.federated_data import build_federated_data

    cfg = load_config(experiment, list(overrides))
    data = build_federated_data(cfg.data, int(cfg.seed))
    train = TensorData.from_arrays(data.bundle.train.x, data.bundle.train.y, torch.device("cpu"))
    test = TensorData.from_arrays(data.bundle.test.x, data.bundle.test.y, torch.device("cpu"))
    pids = list(data.new_clients) or list(range(data.num_clients))
    clients = []
    for pid in pids[:count]:
        tr, te = (torch.as_tensor(data.client_train[pid]), torch.as_tensor(data.client_test[pid]))
        clients.append((train.x[tr].float(), train.y[tr].long(), test.x[te].float(), test.y[te].long()))
    return clients


def cosine(paths: Sequence[Path], out: Path) -> dict:
    """Figure 4 for every model: ``cosine_<i>.png/csv`` each, ``cosine.png`` all, ``cosine.json``."""
    models = open_models(paths)
    out.mkdir(parents=True, exist_ok=True)
    results, matrices = {}, {}
    for i, (path, model, saved) in enumerate(models):
        x, y, names = test_split(saved)
        head = saved["model"]["head"]
        with torch.no_grad():
            features = torch.cat([model.features(x[s:s + 512], head).flatten(1) for s in range(0, len(x), 512)])
        matrix = rep.class_cosine_matrix(features, y, len(names))
        rep.write_cosine(matrix, names, out / f"cosine_{i}.png", out / f"cosine_{i}.csv", _name(saved))
        matrices[_name(saved)] = matrix
        results[_name(saved)] = {"model": str(path), **rep.cosine_summary(matrix)}
    rep.plot_cosine_grid(matrices, out / "cosine.png")
    (out / "cosine.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


def cka(paths: Sequence[Path], clients: list[rep.Client], epochs: int, samples: int, lr: float, batch_size: int,
        seed: int, out: Path) -> dict:
    """Figure 2 for every model: CKA per layer group between the model and its fine-tuned copies."""
    models = open_models(paths)
    out.mkdir(parents=True, exist_ok=True)
    results, layers = {}, None
    for path, model, saved in models:
        layers = list(model.group_names)
        per_client = []
        for index, client in enumerate(clients):
            tuned = _copy(model, saved)
            generator = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, index]).generate_state(1)[0]))
            rep.fine_tune(tuned, client, epochs, min(samples, len(client[0])), lr, batch_size, generator,
                          train_head_only=False)
            per_client.append(rep.cka_by_layer(model, tuned, client[2], layers, 256, minibatch=False))
        results[_name(saved)] = {"model": str(path), "layers": layers,
                                 "cka": [float(v) for v in np.mean(per_client, axis=0)],
                                 "cka_std": [float(v) for v in np.std(per_client, axis=0)]}
    rep.plot_cka_by_layer({k: v["cka"] for k, v in results.items()}, layers or [], out / "cka.png",
                          "CKA between each model and its fine-tuned copy")
    (out / "cka.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


def transfer(paths: Sequence[Path], clients: list[rep.Client], epochs: int, samples: Sequence[int], trials: int,
             lr: float, batch_size: int, seed: int, out: Path) -> dict:
    """Figure 5 for every model: new clients' accuracy after fine-tuning against samples per epoch."""
    models = open_models(paths)
    classes = int(max(int(c[1].max()) for c in clients) + 1)
    for path, _, saved in models:
        if classes > saved["model"]["num_classes"]:
            raise ConfigError(f"the new clients have labels up to {classes - 1}; {path} outputs "
                              f"{saved['model']['num_classes']} classes")
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for path, model, saved in models:
        curve = rep.fine_tune_transfer(functools.partial(_copy, model, saved), model.state_dict(), clients, epochs,
                                       list(samples), trials, lr, batch_size, seed)
        results[_name(saved)] = {"model": str(path), **curve}
    rep.plot_transfer(results, out / "transfer.png", f"fine-tuning on new clients ({epochs} epochs)")
    (out / "transfer.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


def _copy(model: torch.nn.Module, saved: dict) -> torch.nn.Module:
    from task.learning.models import build_model

    spec = saved["model"]
    fresh = build_model(spec["name"], tuple(spec["input_shape"]), spec["num_classes"], rep_dim=spec["rep_dim"],
                        output=spec["output"])
    fresh.load_state_dict(model.state_dict())
    return fresh
