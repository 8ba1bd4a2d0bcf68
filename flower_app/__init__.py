"""Flower plumbing: ServerApp, ClientApp, configuration, results, tracking, CLI."""
