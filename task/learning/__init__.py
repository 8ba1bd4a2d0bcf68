"""Learning: models with named body/head splits, the training and evaluation engine, metrics, fairness."""
