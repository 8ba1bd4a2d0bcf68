"""Loading, merging and validating run configurations (OmegaConf).

A run's configuration is ``conf/base.yaml`` merged with ``conf/experiment/<name>.yaml``
and then with dotted ``key=value`` overrides. Flower's run-config carries two strings:
``experiment`` and ``overrides`` (space-separated ``key=value`` pairs). A relative ``data.root`` is
resolved against the project directory (where ``pyproject.toml`` lives).
"""

from __future__ import annotations

import functools
import math
import shlex
from collections.abc import Iterable, Mapping
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from protocols import PROTOCOLS
from strategies import ALGORITHMS
from strategies.checks import choice, nonnegative, positive, require
from strategies.common import configured_head
from task.errors import ConfigError
from task.learning.models import MODEL_NAMES
from task.data.sources import APP_DIR
from task.data.sources import DATASET_NAMES

PROJECT_DIR = APP_DIR  # relative data.root values are resolved against it
CONF_DIR = PROJECT_DIR / "conf"
FINETUNE_PARTS = ("head", "full")
MODEL_INITS = ("default", "scaled_orthonormal")
DEVICES = ("auto", "cpu", "cuda")


def experiment_names() -> list[str]:
    """Names of the experiment files in ``conf/experiment``."""
    return sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))


def parse_overrides(overrides: str | Iterable[str]) -> list[str]:
    """Split an ``overrides`` run-config string into ``key=value`` items."""
    items = shlex.split(overrides) if isinstance(overrides, str) else list(overrides)
    for item in items:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override '{item}' must have the form key=value (e.g. train.lr=0.1)")
    return items


def load_config(experiment: str, overrides: str | Iterable[str] = ()) -> DictConfig:
    """Merge base, experiment and overrides; unknown keys are errors."""
    exp_path = CONF_DIR / "experiment" / f"{experiment}.yaml"
    if not exp_path.is_file():
        raise ConfigError(
            f"experiment: unknown experiment '{experiment}'; available: {', '.join(experiment_names())}"
        )
    base = OmegaConf.load(CONF_DIR / "base.yaml")
    OmegaConf.set_struct(base, True)
    try:
        cfg = OmegaConf.merge(base, OmegaConf.load(exp_path))
    except OmegaConfBaseException as err:
        raise ConfigError(f"{exp_path}: {err.msg}") from None
    items = parse_overrides(overrides)
    try:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(items))
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", "") or "overrides"
        raise ConfigError(f"{key}: {err.msg}") from None
    OmegaConf.set_struct(cfg, False)
    cfg.experiment = experiment
    if cfg.label is None:
        cfg.label = cfg.algorithm
    if cfg.data.root is not None and not Path(str(cfg.data.root)).expanduser().is_absolute():
        cfg.data.root = str((PROJECT_DIR / str(cfg.data.root)).resolve())
    validate(cfg)
    return cfg


RESERVED_IN_COMPARE = ("compare", "out_dir", "data.num_clients")


def load_variants(experiment: str, overrides: str | Iterable[str] = ()) -> tuple[DictConfig, ...]:
    """The run's configuration, then one configuration per ``compare`` entry.

    Each ``compare`` entry is a string of ``key=value`` overrides applied on top of the
    run's own overrides; its ``label`` (default: its algorithm) names its results and its
    client state, so labels must differ. All variants run on the same federation.
    """
    base_items = parse_overrides(overrides)
    primary = load_config(experiment, base_items)
    variants = [primary]
    for i, entry in enumerate(primary.compare):
        key = f"compare[{i}]"
        require(isinstance(entry, str), key, f"got {entry!r}, expected a string of key=value overrides")
        items = parse_overrides(entry)
        reserved = [item for item in items if item.split("=", 1)[0].strip() in RESERVED_IN_COMPARE]
        require(not reserved, key, f"{reserved} cannot differ between variants of one run")
        try:
            variants.append(load_config(experiment, [*base_items, *items, "compare=[]"]))
        except ConfigError as err:
            raise ConfigError(f"{key} ({entry!r}): {err}") from None
    labels = [v.label for v in variants]
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    require(not duplicates, "compare",
             f"variants {labels} repeat the label(s) {duplicates}; add label=<name> to the entries "
             "(or compare=[] to run the first variant alone)")
    return tuple(variants)


@functools.lru_cache(maxsize=8)
def variants_from_run_config(experiment: str, overrides: str) -> tuple[DictConfig, ...]:
    """Cached :func:`load_variants` for the Flower run-config (one parse per process)."""
    return load_variants(experiment, overrides)


def run_config_of(run_config: Mapping, label: str | None = None) -> DictConfig:
    """The configuration (of variant ``label``; default the first) of a Flower ``context.run_config``."""
    variants = variants_from_run_config(
        str(run_config.get("experiment", "quickstart")), str(run_config.get("overrides", ""))
    )
    if label is None:
        return variants[0]
    for cfg in variants:
        if cfg.label == label:
            return cfg
    raise ConfigError(f"label: this run has no variant {label!r}; variants: {[v.label for v in variants]}")


def validate(cfg: DictConfig) -> None:
    """Check every value that can be checked without loading data; raise ConfigError. The
    algorithm's and the protocols' own rules are theirs (``Algorithm.check``, ``PaperProtocol.check``)."""
    choice(cfg, "algorithm", ALGORITHMS)
    algorithm = ALGORITHMS[cfg.algorithm]
    for protocol in PROTOCOLS:
        protocol.check(cfg)
    choice(cfg, "data.name", DATASET_NAMES)
    choice(cfg, "model.name", MODEL_NAMES)
    choice(cfg, "finetune.part", FINETUNE_PARTS)
    choice(cfg, "simulation.device", DEVICES)
    _validate_server_opt(cfg, algorithm)
    positive(cfg, "lg.goal_accuracy", allow_none=True)
    warm = cfg.lg.fedavg_rounds
    require(warm is None or (isinstance(warm, int) and not isinstance(warm, bool) and warm >= 0), "lg.fedavg_rounds",
             f"got {warm!r}, expected null or an integer >= 0")
    if algorithm.check is not None:
        algorithm.check(cfg)
    require(isinstance(cfg.fair.adversarial, bool), "fair.adversarial",
             f"got {cfg.fair.adversarial!r}, expected true or false")
    local = [n for n, a in ALGORITHMS.items() if a.local_representation]
    require(not cfg.fair.adversarial or algorithm.local_representation, "fair.adversarial",
             f"the adversarial penalty trains local representations (algorithm={', '.join(local)}), not "
             f"'{cfg.algorithm}': a global model cannot be trained against a local adversary (LG-FedAvg Section 5.3)")
    lambdas = cfg.fair.lambdas
    require(OmegaConf.is_list(lambdas) and all(isinstance(v, (int, float)) and v >= 0 for v in lambdas),
             "fair.lambdas", f"got {lambdas!r}, expected a list of numbers >= 0, one per protected attribute")
    for key in ("fair.pretrain_epochs", "fair.postfit_epochs"):
        nonnegative(cfg, key)
    online_on = bool(cfg.data.online_device.enabled)
    require(isinstance(cfg.online.rounds, int) and not isinstance(cfg.online.rounds, bool) and cfg.online.rounds >= 0,
             "online.rounds", f"got {cfg.online.rounds!r}, expected an integer >= 0")
    require(cfg.online.rounds == 0 or online_on, "online.rounds",
             "the online phase needs its device: set data.online_device.enabled=true (and count it in data.num_clients)")
    require(not online_on or cfg.online.rounds > 0, "data.online_device.enabled",
             "the online device only trains in the online phase: set online.rounds > 0")
    fraction_c = cfg.online.fraction
    require(isinstance(fraction_c, (int, float)) and 0 <= fraction_c <= 1, "online.fraction",
             f"got {fraction_c!r}, expected a fraction in [0, 1]")
    positive(cfg, "online.start_accuracy", allow_none=True)
    choice(cfg, "model.init", MODEL_INITS)
    choice(cfg, "train.augment", ("none", "crop_flip"))
    require(cfg.model.init == "default" or cfg.model.name == "linear_rep", "model.init",
             f"'scaled_orthonormal' is defined for model.name=linear_rep, got {cfg.model.name!r}")
    positive(cfg, "new_clients.lr", allow_none=True)
    positive(cfg, "new_clients.tasks", integer=True)
    samples = cfg.new_clients.samples
    require(OmegaConf.is_list(samples) and all(isinstance(n, int) and n >= 1 for n in samples),
             "new_clients.samples", f"got {samples!r}, expected a list of sample counts >= 1")
    require(isinstance(cfg.label, str) and cfg.label.replace("-", "").replace("_", "").replace("+", "").isalnum(),
             "label", f"got {cfg.label!r}, expected a name of letters, digits, '-', '_' or '+'")
    require(isinstance(cfg.seed, int) and not isinstance(cfg.seed, bool), "seed", f"got {cfg.seed!r}, expected an integer")
    for key in ("rounds", "train.batch_size", "data.num_clients", "eval.every", "eval.batch_size"):
        positive(cfg, key, integer=True)
    positive(cfg, "train.local_epochs", integer=True)
    positive(cfg, "train.local_steps", integer=True, allow_none=True)
    positive(cfg, "train.lr")
    positive(cfg, "train.lr_decay")
    positive(cfg, "finetune.lr", allow_none=True)
    for key in ("train.momentum", "train.weight_decay", "finetune.epochs", "new_clients.epochs", "client_state.disk_above_bytes",
                "eval.final_window", "data.num_new_clients", "simulation.client_gpus"):
        nonnegative(cfg, key)
    positive(cfg, "simulation.client_cpus")
    require(OmegaConf.is_list(cfg.compare), "compare", f"got {cfg.compare!r}, expected a list of override strings")
    fraction = cfg.train.fraction
    require(
        isinstance(fraction, (int, float)) and 0 < fraction <= 1,
        "train.fraction",
        f"got {fraction!r}, expected a fraction in (0, 1]",
    )
    trainable = cfg.data.num_clients - cfg.data.num_new_clients
    require(
        trainable >= 1,
        "data.num_new_clients",
        f"{cfg.data.num_new_clients} held-out clients leave no training client out of data.num_clients={cfg.data.num_clients}",
    )
    head = cfg.model.head
    require(
        head is None or (OmegaConf.is_list(head) and len(head) > 0),
        "model.head",
        f"got {head!r}, expected null or a non-empty list of layer names",
    )
    positive(cfg, "faults.min_replies", integer=True)
    require(cfg.faults.min_replies <= clients_per_round(cfg), "faults.min_replies",
             f"{cfg.faults.min_replies} replies can never arrive from the {clients_per_round(cfg)} clients sampled per round")
    positive(cfg, "faults.reply_timeout_s", allow_none=True)
    nonnegative(cfg, "faults.node_wait_s")


def _validate_server_opt(cfg: DictConfig, algorithm) -> None:
    """``server_opt.name`` against the algorithm's server optimizers, and its numbers."""
    if algorithm.server_opts == ("none",):
        with_opts = [n for n, a in ALGORITHMS.items() if a.server_opts != ("none",)]
        require(cfg.server_opt.name == "none", "server_opt.name",
                 f"server optimizers apply to algorithm={' and '.join(with_opts)}; '{cfg.algorithm}' has none (use none)")
    else:
        choice(cfg, "server_opt.name", algorithm.server_opts)
    positive(cfg, "server_opt.lr")
    positive(cfg, "server_opt.tau")
    for key in ("server_opt.momentum", "server_opt.beta_1", "server_opt.beta_2"):
        value = OmegaConf.select(cfg, key)
        require(isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1, key,
                 f"got {value!r}, expected a number in [0, 1)")


def clients_per_round(cfg: DictConfig) -> int:
    """Number of clients sampled each round: ceil(C · #training clients), at least 1."""
    trainable = cfg.data.num_clients - cfg.data.num_new_clients - int(bool(cfg.data.online_device.enabled))
    return max(1, min(trainable, math.ceil(cfg.train.fraction * trainable - 1e-9)))


def head_groups(cfg: DictConfig, model) -> list[str]:
    """The configured head groups of ``model`` (validated against the model's groups)."""
    return configured_head(model, cfg)


def validate_with_data(cfg: DictConfig):
    """Load the data and build the seeded initial model: data-path, file-format and
    layer-name errors surface here, before any round. Returns (FederatedData, model)."""
    from task.data.federated_data import build_federated_data

    fed = build_federated_data(cfg.data, int(cfg.seed))
    model = initial_model(cfg, fed.bundle)
    head_groups(cfg, model)  # model.head names groups of this model
    require(cfg.train.augment == "none" or len(fed.bundle.input_shape) == 3, "train.augment",
             f"'{cfg.train.augment}' needs image inputs (C, H, W), data.name={cfg.data.name!r} has {tuple(fed.bundle.input_shape)}")
    algorithm = ALGORITHMS[cfg.algorithm]
    if algorithm.check_model is not None:
        algorithm.check_model(cfg, fed, model)
    if cfg.model.name == "adult_fair":
        attrs = fed.bundle.train.attributes or {}
        require(cfg.data.name == "adult" and cfg.data.adult_split == "fairness", "model.name",
                 f"adult_fair needs binary protected attributes: data.name=adult with data.adult_split=fairness "
                 f"(got data.name={cfg.data.name!r}, adult_split={cfg.data.adult_split!r})")
        require(len(cfg.fair.lambdas) == len(attrs), "fair.lambdas",
                 f"{len(cfg.fair.lambdas)} values for the {len(attrs)} protected attributes {list(attrs)}")
    return fed, model



def initial_model(cfg: DictConfig, bundle):
    """The run's model with its seeded initial weights (identical on server and clients)."""
    import torch

    from task.learning.models import build_model

    torch.manual_seed(int(cfg.seed))
    model = build_model(cfg.model.name, tuple(bundle.input_shape), int(bundle.num_classes), rep_dim=int(cfg.data.synthetic.k))
    if cfg.model.init == "scaled_orthonormal":
        from task.analysis.linear_rep import scaled_orthonormal_init

        scaled_orthonormal_init(model, float(cfg.train.lr), torch.Generator().manual_seed(int(cfg.seed)))
    return model


def pick_device(cfg: DictConfig):
    """``simulation.device``: ``auto`` picks CUDA when available."""
    import torch

    if cfg.simulation.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.simulation.device)
