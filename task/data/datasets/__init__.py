"""Dataset loaders, one module per source; :mod:`task.data.sources` is the public entry point."""
