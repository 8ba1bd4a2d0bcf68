"""A finished (or checkpointed) run's model as one loadable file, for analyses outside the run.

``flrep export <run-dir>`` reads the run's last server checkpoint and writes ``model.pt``: the
model's name and shapes, and a full ``state_dict`` made of the run's global arrays over the
run's seeded initial model. What the server never holds stays on the clients and is *not* in
the file: a FedRep/FedPer client's head, an LG-FedAvg client's local part, a Local-only
model. Those entries (``local_keys`` lists them) keep what a new client starts from: the
common initial weights, or for LG-FedAvg the warm-start model's local part that its server
keeps and hands to clients without one. A TCT checkpoint after stage 1 holds the linear model on eNTK
features, not the network; run TCT with ``rounds=<tct.stage1_rounds>`` to export its stage-1
model.

A failed run (its ``summary.json`` says so) is refused: its model is not a result.
:func:`load_model` rebuilds the model from the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from flower_app.app import checkpoint
from flower_app.run.run_dir import read_summary
from task.errors import ConfigError
from task.files import load_torch

#: The layout of ``model.pt``.
FORMAT = 1
MODEL_FILE = "model.pt"


def export_model(run_dir: Path, out: Path | None = None) -> Path:
    """Write ``run_dir``'s model file (default ``<run_dir>/model.pt``, never over an existing
    file); its path."""
    run_dir = run_dir.expanduser().resolve()
    out = (out or run_dir / MODEL_FILE).expanduser().resolve()
    if out.exists():
        raise ConfigError(f"--out {str(out)!r} exists: give another path (nothing is overwritten)")
    model, saved = model_from_run(run_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({**saved, "state_dict": model.state_dict()}, out)
    return out


def model_from_run(run_dir: Path) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The model of ``run_dir``'s last checkpoint and the model file's other fields."""
    from flower_app.run.config import initial_model
    from strategies import ALGORITHMS
    from task.data.federated_data import build_federated_data

    if not (checkpoint.checkpoint_dir(run_dir) / checkpoint.SERVER_FILE).is_file():
        variants = sorted(p.name for p in run_dir.iterdir()
                          if (checkpoint.checkpoint_dir(p) / checkpoint.SERVER_FILE).is_file()) if run_dir.is_dir() else []
        hint = f"; this is a comparison: export one variant, e.g. {run_dir / variants[0]}" if variants else ""
        raise ConfigError(f"run-dir {str(run_dir)!r}: no server checkpoint ({checkpoint.SERVER_FILE}){hint}")
    refuse_failed(run_dir)
    state = checkpoint.read(run_dir, f"run-dir {str(run_dir)!r}")
    cfg = OmegaConf.create(state["config"])
    bundle = build_federated_data(cfg.data, int(cfg.seed)).bundle
    model = initial_model(cfg, bundle)
    full = model.state_dict()
    arrays = {k: torch.as_tensor(v) for k, v in state["arrays"].items()}
    foreign = sorted(set(arrays) - set(full))
    if foreign:
        raise ConfigError(f"run-dir {str(run_dir)!r}: its global arrays ({', '.join(foreign[:4])}) are not "
                          f"weights of {cfg.model.name}: at its last round the server held other arrays (e.g. a "
                          "linear model on features); export a run stopped before that stage")
    for key, value in arrays.items():
        if value.shape != full[key].shape:
            raise ConfigError(f"run-dir {str(run_dir)!r}: array {key} has shape {tuple(value.shape)}, "
                              f"{cfg.model.name} expects {tuple(full[key].shape)}")
        full[key] = value.to(full[key].dtype)
    model.load_state_dict(full)
    trained = ALGORITHMS[cfg.algorithm].trained_global_keys
    global_keys = sorted(set(arrays) & set(trained(model, cfg))) if trained is not None else sorted(arrays)
    return model, {
        "format": FORMAT,
        "model": {"name": str(cfg.model.name), "input_shape": [int(d) for d in bundle.input_shape],
                  "num_classes": int(bundle.num_classes), "output": str(cfg.model.output),
                  "rep_dim": int(cfg.data.synthetic.k), "head": list(model.default_head if cfg.model.head is None
                                                                  else cfg.model.head)},
        "global_keys": global_keys,
        "local_keys": sorted(set(full) - set(global_keys)),
        "run": {"dir": str(run_dir), "experiment": cfg.experiment, "algorithm": cfg.algorithm, "label": cfg.label,
                "seed": int(cfg.seed), "round": int(state["round"]), "dataset": str(cfg.data.name)},
        "data": OmegaConf.to_container(cfg.data, resolve=True),
    }


def refuse_failed(run_dir: Path) -> None:
    """Raise :class:`ConfigError` when ``run_dir``'s ``summary.json`` records a failed run (e.g. one
    that diverged or learned nothing): its weights would make every analysis of them a lie."""
    summary = read_summary(run_dir) or {}  # none: a run still going (or stopped) exports its last checkpoint
    if summary.get("status") == "failed":
        raise ConfigError(f"run-dir {str(run_dir)!r}: the run failed ({summary.get('failure_reason', 'no reason given')}"
                          "); its model is not a result to export or diagnose")


def load_model(path: Path) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The model of a ``model.pt`` (in eval mode) and the file's other fields."""
    from task.learning.models import build_model

    try:
        saved = load_torch(Path(path).expanduser())
    except Exception as err:  # noqa: BLE001 - name the file
        raise ConfigError(f"{path}: cannot be read as a flrep model file ({type(err).__name__}: {err})") from None
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise ConfigError(f"{path}: not a flrep model file of format {FORMAT} (write one with flrep export)")
    spec = saved["model"]
    model = build_model(spec["name"], tuple(spec["input_shape"]), spec["num_classes"], rep_dim=spec["rep_dim"],
                        output=spec["output"])
    model.load_state_dict(saved["state_dict"])
    return model.eval(), saved
