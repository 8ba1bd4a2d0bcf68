"""What the commands other than ``flrep run`` do: a local deployment and its keys, the local
SuperLink, a run's model export, representation diagnostics, round benchmarks, the catalogue."""
