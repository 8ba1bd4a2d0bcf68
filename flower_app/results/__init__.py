"""What a run leaves: its results files, plots, comparison tables and tracking."""
