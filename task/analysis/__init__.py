"""Analysis: the LocalUpdate surrogate and Pareto frontiers, LG-FedAvg synthetic study, linear representations."""
