"""The Flower app itself: ServerApp, ClientApp, the round loop and what it talks through."""
