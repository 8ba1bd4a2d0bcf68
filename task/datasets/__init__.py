"""Dataset loaders, one module per source; :mod:`task.sources` is the public entry point."""
