"""A run's setup and safety: configuration and its checks, the run folder and its lock, stop signals, the engine's start."""
