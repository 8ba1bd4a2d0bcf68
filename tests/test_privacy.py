"""What a client keeps as private (heads, personal models, local parts, whole local models, α)
never crosses the wire in either direction, checked by value through ``flrep run`` (the simulation
engine, two Ray workers) with the recording plug-in :mod:`tests.privacy_spy`; three leaky clients
show that the check finds what it looks for."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.privacy import FOLDER, calls, leaks

pytestmark = pytest.mark.slow  # one 2.5-minute run through the engine: the slow suite (README)

ROOT = Path(__file__).resolve().parents[1]
BASE = ["quickstart", "wandb.enabled=false", "data.num_clients=6", "train.fraction=0.5", "rounds=4", "eval.every=2",
        "eval.final_window=1", "simulation.client_cpus=1", "plugins=[tests.privacy_leaks,tests.privacy_spy]"]
PRIVATE = {  # label -> a run in which clients keep private state
    "ditto": "algorithm=ditto",
    "apfl": "algorithm=apfl apfl.adaptive=true",
    "apfl-official": "algorithm=apfl apfl.variant=official apfl.start=received",  # v starts as the received w
    "ditto-received": "algorithm=ditto ditto.start=received",
    "fedrep": "algorithm=fedrep fedrep.head_epochs=1",
    "fedper": "algorithm=fedper",
    "lg_fedavg": "algorithm=lg_fedavg lg.fedavg_rounds=1 lg.global_part=[fc2]",
    "local_only": "algorithm=local_only",
    "fed_mtl": "algorithm=fed_mtl",
    "fedproto": "algorithm=fedproto",  # whole models kept; class prototypes (no kept value) go up
    "fedala": "algorithm=fedala",  # its ALA weights W (its kept model is its upload)
    "feddbe": "algorithm=feddbe",  # its bias memory mu_i (PRBM)
    "fedbn": "algorithm=fedbn model.name=digits_mlp_bn rounds=12 eval.every=4",  # its batch-norm layers (4 rounds learn nothing)
    "pfedme": "algorithm=pfedme",  # its personal model theta_i
    "fedrod": "algorithm=fedrod",  # its personal head
}
LG_SELECTION = "algorithm=lg_fedavg lg.fedavg_rounds=1 lg.global_part=[fc2] eval.every=1 new_test.enabled=true new_test.models=best"
LEAKY = {  # label -> a client that leaks on purpose
    "leaky-names": "algorithm=leaky_ditto_names",  # its personal model under the global model's names
    "leaky-update": "algorithm=leaky_ditto_update",  # its personal model's update, scaled by (1 + 1e-6)
    "apfl-reports-alpha": "algorithm=apfl apfl.adaptive=true apfl.report_alpha=true",  # a private scalar in its metrics
}
SCAFFOLD = "algorithm=scaffold"
FEDAMP = "algorithm=fedamp"  # every client's own model goes up by design
VARIANTS = {**PRIVATE, "lg-selection": LG_SELECTION, **LEAKY, "scaffold": SCAFFOLD, "fedamp": FEDAMP}


def shared_by_design(label: str):
    """Kept values a run sends by design: Fed-MTL's regularised first layers; FedALA's local model
    (its upload); the accuracy of the best local part LG's selection keeps (every evaluation reply
    reports its accuracy)."""
    if label == "fed_mtl":
        return lambda name: name.rsplit("/", 1)[-1].startswith("fc1.")
    if label == "fedala":  # the kept local model is what it sends; W is private
        return lambda name: name.startswith("fedala/local-model/")
    if label == "lg-selection":
        return lambda name: name.endswith("/lg-best/accuracy")
    return lambda name: False


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    """One ``flrep run`` of every variant (one Ray start); its output folder."""
    out = tmp_path_factory.mktemp("privacy") / "run"
    (first, first_overrides), *rest = VARIANTS.items()
    compare = "compare=[" + ",".join(f"'{o} label={label}'" for label, o in rest) + "]"
    proc = subprocess.run([sys.executable, "-m", "flower_app.cli", "run", *BASE, *first_overrides.split(),
                           f"label={first}", compare, "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for label in VARIANTS:
        summary = json.loads((out / label / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["failed_client_replies"] == 0, label
    return out


def _calls(recorded: Path, label: str):
    return calls(recorded / FOLDER / label)


def test_every_client_message_was_recorded_in_the_ray_workers(recorded):
    for label in VARIANTS:
        kinds = {c.kind for c in _calls(recorded, label)}
        assert "train" in kinds, label
    assert len({c.pid for c in _calls(recorded, "ditto")}) == 6


@pytest.mark.parametrize("label", list(PRIVATE))
def test_no_value_a_client_keeps_crosses_the_wire(recorded, label):
    assert leaks(_calls(recorded, label), shared_by_design(label)) == []


def test_lg_selection_passes_carry_no_private_value(recorded):
    """LG-FedAvg with main_lg.py's selection (new_test.models=best): its passes send the averaged
    global part down and accuracies up; the only private arrays on the wire are New Test's uploads."""
    found = leaks(_calls(recorded, "lg-selection"), shared_by_design("lg-selection"))
    assert found and all(line.startswith("up query.localpart ") for line in found), found
    assert any(c.kind == "query.lgselect" for c in _calls(recorded, "lg-selection"))


def test_the_check_finds_a_personal_model_sent_under_the_global_models_names(recorded):
    found = leaks(_calls(recorded, "leaky-names"))
    assert found and all(line.startswith("up train") and "personal-model" in line for line in found), found


def test_the_check_finds_a_personal_models_update_scaled_by_one_plus_a_millionth(recorded):
    """Round 1 gives v itself away (it moved from the common initial weights w came from), by
    closeness; every later round only by its update."""
    found = leaks(_calls(recorded, "leaky-update"))
    assert found and all(line.startswith("up train") for line in found), found
    assert any("(by update)" in line for line in found), found


def test_the_check_finds_a_private_scalar_in_the_metrics(recorded):
    found = leaks(_calls(recorded, "apfl-reports-alpha"))
    assert found and all("metrics/alpha=" in line and "(by scalar)" in line for line in found), found
    assert not leaks(_calls(recorded, "apfl"))  # the same run without apfl.report_alpha


def test_fedamp_sends_up_only_each_clients_own_model(recorded):
    """FedAMP uploads w_i by design; nothing a client keeps goes down, and no client's model reaches another."""
    found = leaks(_calls(recorded, "fedamp"))
    assert found and all(re.match(r"up train of partition (\d+): .* is partition \1 keeps fedamp/own-model/", line)
                         for line in found), found


def test_the_server_can_rebuild_each_scaffold_control_variate_from_its_updates(recorded):
    """docs/algorithms.md: SCAFFOLD's Δc_i go up by design, and their sum is c_i itself."""
    by_client: dict[int, list] = {}
    for call in _calls(recorded, "scaffold"):
        if call.kind == "train":
            by_client.setdefault(call.pid, []).append(call)
    assert by_client
    for pid, trained in by_client.items():
        kept = {name.rsplit("/", 1)[-1]: value for name, value in trained[-1].kept_after.items()
                if "/scaffold-ci/" in name}
        sent = {}
        for call in trained:
            for key, delta in call.up.items():
                if key.startswith("control/"):
                    sent[key.split("/", 1)[1]] = sent.get(key.split("/", 1)[1], 0) + delta.astype(np.float64)
        assert kept and sorted(kept) == sorted(sent), pid
        for key, value in kept.items():
            np.testing.assert_allclose(sent[key], value, rtol=1e-5, atol=1e-7, err_msg=f"partition {pid} {key}")
