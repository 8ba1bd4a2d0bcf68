"""TCT: eNTK features and the stage-2 linear problem."""
