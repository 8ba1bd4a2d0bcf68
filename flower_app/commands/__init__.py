"""The ``flrep`` commands around runs, one module per command."""
