"""Loading, merging and validating run configurations (OmegaConf).

A run's configuration is ``conf/base.yaml`` merged with ``conf/experiment/<name>.yaml``
and then with dotted ``key=value`` overrides. Flower's run-config carries two strings:
``experiment`` and ``overrides`` (space-separated ``key=value`` pairs). A null or relative
``data.root`` is resolved in the data home (:mod:`task.data.home`).
"""

from __future__ import annotations

import functools
import math
import shlex
from collections.abc import Iterable, Mapping
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from protocols import PROTOCOLS
from strategies import ALGORITHMS
from flower_app.app.plugins import load_plugins
from flower_app.run.schema import run_schema
from flower_app.run.flat_config import experiment_of, overrides_of
from flower_app.run.smoke import as_overrides, smoke_changes
from flower_app.run.suggest import choices_at, did_you_mean
from flower_app.run.experiment_files import experiment_names
from strategies.checks import allowed_at, check_ranges, require
from strategies.common import configured_head
from task.errors import ConfigError
from task.data.home import resolve_root
from task.data.sources import APP_DIR

PROJECT_DIR = APP_DIR
CONF_DIR = PROJECT_DIR / "conf"


def parse_overrides(overrides: str | Iterable[str]) -> list[str]:
    """Split an ``overrides`` run-config string into ``key=value`` items."""
    items = shlex.split(overrides) if isinstance(overrides, str) else list(overrides)
    for item in items:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override '{item}' must have the form key=value (e.g. train.lr=0.1)")
    return items


def load_config(experiment: str, overrides: str | Iterable[str] = ()) -> DictConfig:
    """Merge base, experiment and overrides into the run schema (:mod:`flower_app.run.schema`):
    OmegaConf checks types, choices, unknown and missing keys; then the ranges and the
    rules across keys. Every error is a ConfigError naming the key (and file) and what is allowed."""
    exp_path = CONF_DIR / "experiment" / f"{experiment}.yaml"
    if not exp_path.is_file():
        raise ConfigError(
            f"experiment: unknown experiment '{experiment}'; available: {', '.join(experiment_names())}"
            f"{did_you_mean(experiment, experiment_names())}"
        )
    load_plugins(_plugins_named((CONF_DIR / "base.yaml", exp_path), overrides))
    schema = run_schema()
    cfg = OmegaConf.structured(schema)
    for path in (CONF_DIR / "base.yaml", exp_path):
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.load(path))
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML ({_yaml_problem(err)})") from None
        except OmegaConfBaseException as err:
            raise ConfigError(f"{path}: {_explain(err, schema)}") from None
    for item in parse_overrides(overrides):
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([item]))
        except yaml.YAMLError as err:
            raise ConfigError(f"override {item!r}: its value is not valid YAML ({_yaml_problem(err)})") from None
        except OmegaConfBaseException as err:
            raise ConfigError(_explain(err, schema)) from None
    missing = sorted(OmegaConf.missing_keys(cfg))
    require(not missing, missing[0] if missing else "", f"no value given (missing keys: {', '.join(missing)})")
    cfg.experiment = experiment
    if cfg.label is None:
        cfg.label = cfg.algorithm
    if cfg.data.source == "local" and (root := resolve_root(cfg.data.name, cfg.data.root)) is not None:
        cfg.data.root = str(root)
    check_ranges(cfg, schema)
    validate(cfg)
    return cfg


def _plugins_named(files: Iterable[Path], overrides: str | Iterable[str]) -> list[str]:
    """The ``plugins`` modules the files and overrides name (read before the schema, which needs them)."""
    modules: object = []
    for path in files:
        try:
            modules = OmegaConf.load(path).get("plugins", modules)
        except (yaml.YAMLError, OmegaConfBaseException):
            pass  # reported with its file by the full merge
    for item in parse_overrides(overrides):
        if item.partition("=")[0].strip() == "plugins":
            try:
                modules = OmegaConf.from_dotlist([item]).plugins
            except (yaml.YAMLError, OmegaConfBaseException):
                raise ConfigError(f"override {item!r}: expected plugins=[module, ...]") from None
    modules = OmegaConf.to_container(modules) if OmegaConf.is_list(modules) else modules
    if not isinstance(modules, list) or not all(isinstance(m, str) and m for m in modules):
        raise ConfigError(f"plugins: got {modules!r}, expected a list of module names, e.g. plugins=[my_ditto]")
    return modules


def base_defaults() -> dict:
    """The schema (of the algorithms registered now) merged with ``conf/base.yaml``, as plain
    data: the value of a key in a run written before the key existed (a key is added with the
    default that keeps what runs did)."""
    cfg = OmegaConf.merge(OmegaConf.structured(run_schema()), OmegaConf.load(CONF_DIR / "base.yaml"))
    return OmegaConf.to_container(cfg, resolve=False)


def _yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML error in one line: what and where (line and column, 1-based)."""
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{getattr(err, 'problem', None) or type(err).__name__}{where}"


def _explain(err: OmegaConfBaseException, schema: type) -> str:
    """An OmegaConf error as ``key: what went wrong, what is allowed``."""
    key = str(getattr(err, "full_key", "") or "")
    if isinstance(err, ConfigKeyError) and key:
        parent = key.rpartition(".")[0]
        root = OmegaConf.structured(schema)
        known = OmegaConf.select(root, parent) if parent else root
        hint = (f"; {parent} has {', '.join(known.keys())}" if parent and OmegaConf.is_dict(known)
                else "; the keys are those of conf/base.yaml and the registered algorithms' sections")
        names = [str(k) for k in known.keys()] if OmegaConf.is_dict(known) else []
        return f"{key}: unknown key{hint}{did_you_mean(key.rpartition('.')[2], names, f'{parent}.' if parent else '')}"
    allowed = allowed_at(schema, key) if key else None
    if isinstance(err, ValidationError) and allowed is not None:
        value = getattr(err, "value", None)
        plugin = (f"; if {value!r} is a plug-in's algorithm, name its module: plugins=[<module>] "
                  "(docs/extending.md)") if key == "algorithm" else ""  # perhaps one whose module was not named
        return f"{key}: got {value!r}, expected {allowed}{plugin}{did_you_mean(str(value), choices_at(schema, key))}"
    return f"{key or 'overrides'}: {str(err.msg).splitlines()[0]}"


RESERVED_IN_COMPARE = ("compare", "out_dir", "data.num_clients")


def load_variants(experiment: str, overrides: str | Iterable[str] = ()) -> tuple[DictConfig, ...]:
    """The run's configuration, then one configuration per ``compare`` entry.

    Each ``compare`` entry is a string of ``key=value`` overrides applied on top of the
    run's own overrides; its ``label`` (default: its algorithm) names its results and its
    client state, so labels must differ. All variants run on the same federation.
    """
    base_items = parse_overrides(overrides)
    primary = load_config(experiment, base_items)
    if primary.smoke:  # each variant as it would be, then shortened (flower_app/run/smoke.py)
        return tuple(load_config(experiment, [*items, *as_overrides(smoke_changes(cfg)), "smoke=true"])
                     for cfg, items in _variant_items(experiment, [*base_items, "smoke=false"]))
    return tuple(cfg for cfg, _ in _variant_items(experiment, base_items, primary))


def _variant_items(experiment: str, base_items: list[str],
                   primary: DictConfig | None = None) -> list[tuple[DictConfig, list[str]]]:
    """Each variant's configuration and the overrides that make it (the run's, then its entry's)."""
    primary = primary if primary is not None else load_config(experiment, base_items)
    variants = [(primary, base_items)]
    for i, entry in enumerate(primary.compare):
        key = f"compare[{i}]"
        items = parse_overrides(entry)
        reserved = [item for item in items if item.split("=", 1)[0].strip() in RESERVED_IN_COMPARE]
        require(not reserved, key, f"{reserved} cannot differ between variants of one run")
        try:
            variant_items = [*base_items, *items, "compare=[]"]
            variants.append((load_config(experiment, variant_items), variant_items))
        except ConfigError as err:
            raise ConfigError(f"{key} ({entry!r}): {err}") from None
    labels = [v.label for v, _ in variants]
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    require(not duplicates, "compare",
             f"variants {labels} repeat the label(s) {duplicates}; add label=<name> to the entries "
             "(or compare=[] to run the first variant alone)")
    return variants


def shadowed_overrides(experiment: str, overrides: str | Iterable[str]) -> list[str]:
    """A line for each of the run's overrides that a ``compare`` entry sets again, and so does
    not reach that variant (``rounds=3`` against ``"algorithm=local_only rounds=450"``)."""
    items = parse_overrides(overrides)
    given = {item.split("=", 1)[0].strip(): item for item in items}
    lines = []
    for i, entry in enumerate(load_config(experiment, items).compare):
        for item in parse_overrides(entry):
            key = item.split("=", 1)[0].strip()
            if key in given and given[key] != item:
                lines.append(f"{given[key]} does not reach compare[{i}] ({entry!r}): its own {item} wins "
                             "(smoke=true shortens every variant)")
    return lines


@functools.lru_cache(maxsize=8)
def variants_from_run_config(experiment: str, overrides: str) -> tuple[DictConfig, ...]:
    """Cached :func:`load_variants` for the Flower run-config (one parse per process)."""
    return load_variants(experiment, overrides)


def run_config_of(run_config: Mapping, label: str | None = None) -> DictConfig:
    """The configuration (of variant ``label``; default the first) of a Flower ``context.run_config``."""
    variants = variants_from_run_config(experiment_of(run_config), overrides_of(run_config))
    if label is None:
        return variants[0]
    for cfg in variants:
        if cfg.label == label:
            return cfg
    raise ConfigError(f"label: this run has no variant {label!r}; variants: {[v.label for v in variants]}")


def validate(cfg: DictConfig) -> None:
    """The rules across keys of the core, then the algorithm's and the protocols' own
    (``Algorithm.check``, ``PaperProtocol.check``); raise ConfigError."""
    algorithm = ALGORITHMS[cfg.algorithm]
    for protocol in PROTOCOLS:
        protocol.check(cfg)
    _validate_server_opt(cfg, algorithm)
    if algorithm.check is not None:
        algorithm.check(cfg)
    require(cfg.model.init == "default" or cfg.model.name == "linear_rep", "model.init",
            f"'scaled_orthonormal' is defined for model.name=linear_rep, got {cfg.model.name!r}")
    require(cfg.label.replace("-", "").replace("_", "").replace("+", "").isalnum(),
            "label", f"got {cfg.label!r}, expected a name of letters, digits, '-', '_' or '+'")
    trainable = cfg.data.num_clients - cfg.data.num_new_clients
    require(
        trainable >= 1,
        "data.num_new_clients",
        f"{cfg.data.num_new_clients} held-out clients leave no training client out of data.num_clients={cfg.data.num_clients}",
    )
    require(cfg.model.head is None or len(cfg.model.head) > 0, "model.head",
            "got [], expected null or a non-empty list of layer names")
    require(cfg.faults.min_replies <= clients_per_round(cfg), "faults.min_replies",
            f"{cfg.faults.min_replies} replies can never arrive from the {clients_per_round(cfg)} clients sampled per round")


def _validate_server_opt(cfg: DictConfig, algorithm) -> None:
    """``server_opt.name`` against the algorithm's server optimizers."""
    if algorithm.server_opts == ("none",):
        with_opts = [n for n, a in ALGORITHMS.items() if a.server_opts != ("none",)]
        require(cfg.server_opt.name == "none", "server_opt.name",
                f"server optimizers apply to algorithm={' and '.join(with_opts)}; '{cfg.algorithm}' has none (use none)")
    else:
        require(cfg.server_opt.name in algorithm.server_opts, "server_opt.name",
                f"unknown value {cfg.server_opt.name!r}; allowed: {', '.join(algorithm.server_opts)}")


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
    head = head_groups(cfg, model)  # model.head names groups of this model
    algorithm = ALGORITHMS[cfg.algorithm]
    require(algorithm.shared_keys is None or bool(algorithm.shared_keys(model, cfg)), "model.head",
            f"{head} is the whole {cfg.model.name}: {cfg.algorithm} would share no parameters; name fewer layer groups")
    require(cfg.train.augment == "none" or len(fed.bundle.input_shape) == 3, "train.augment",
             f"'{cfg.train.augment}' needs image inputs (C, H, W), data.name={cfg.data.name!r} has {tuple(fed.bundle.input_shape)}")
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
    model = build_model(cfg.model.name, tuple(bundle.input_shape), int(bundle.num_classes),
                        rep_dim=int(cfg.data.synthetic.k), output=cfg.model.output)
    if cfg.model.init == "scaled_orthonormal":
        from task.analysis.linear_rep import scaled_orthonormal_init

        scaled_orthonormal_init(model, float(cfg.train.lr), torch.Generator().manual_seed(int(cfg.seed)))
    return model


def pick_device(cfg: DictConfig):
    """``simulation.device``: ``auto`` picks CUDA when available."""
    import torch

    if cfg.simulation.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    require(cfg.simulation.device != "cuda" or torch.cuda.is_available(), "simulation.device",
            "cuda, but torch sees no CUDA GPU on this machine; use auto or cpu")
    return torch.device(cfg.simulation.device)


def server_device(cfg: DictConfig):
    """The device of the ServerApp's own evaluation: ``eval.server_device`` (``cpu``, ``cuda`` or
    ``cuda:N``, N counted in ``CUDA_VISIBLE_DEVICES``), else :func:`pick_device`."""
    import torch

    name = cfg.eval.server_device
    if not name:
        return pick_device(cfg)
    require(name == "cpu" or name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit()), "eval.server_device",
            f"{name!r} is not a device: use cpu, cuda or cuda:N")
    if name == "cpu":
        return torch.device("cpu")
    count = visible_gpus()
    index = int(name[5:]) if ":" in name else 0
    require(index < count, "eval.server_device", f"{name}, but torch sees {count} CUDA GPU(s) on this machine "
            "(CUDA_VISIBLE_DEVICES counts)")
    return torch.device(name)


def visible_gpus() -> int:
    """The CUDA GPUs this process sees (``CUDA_VISIBLE_DEVICES`` respected, as Ray does)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
