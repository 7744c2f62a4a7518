"""The OpenAI-compatible HTTP server: `create_app(engine, config)` and `specdec serve`."""
from specdec.server.app import create_app
from specdec.server.config import ServerConfig

__all__ = ["create_app", "ServerConfig"]
