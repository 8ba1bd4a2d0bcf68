"""wandb can never fail a run: unreachable servers and errors turn tracking off."""

from omegaconf import OmegaConf

import flower_app.results.tracking as tracking


def test_unreachable_wandb_server_disables_tracking(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setattr(tracking, "INIT_TIMEOUT_S", 5)
    cfg = OmegaConf.create({"wandb": {"enabled": True, "mode": "online", "project": "p", "entity": None}})
    tracker = tracking.Tracker(cfg, tmp_path, "run")
    assert tracker.run is None
    tracker.log({"acc": 0.5}, step=1)
    tracker.finish({"acc": 0.5})


def test_offline_is_the_default_mode(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = OmegaConf.create({"wandb": {"enabled": True, "mode": None, "project": "p", "entity": None}})
    tracker = tracking.Tracker(cfg, tmp_path, "run")
    assert tracker.run is not None and tracker.run.settings.mode == "offline"
    tracker.log({"acc": 0.5, "clients": [1, 2]}, step=1)
    tracker.finish({"acc": 0.5})
    assert list((tmp_path / "wandb").glob("offline-run-*"))
