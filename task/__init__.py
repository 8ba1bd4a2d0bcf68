"""Framework-free machine-learning code: data, models, training loops, metrics (no Flower imports)."""
