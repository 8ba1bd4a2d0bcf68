"""Paper tables: their registry and ``flrep reproduce``'s runs of their cells over seeds."""
