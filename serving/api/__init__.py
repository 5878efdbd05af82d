"""OpenAI-compatible HTTP API: `build_app(engine, tokenizer, served_model_name, api_key)`."""

from serving.api.server import APIError, build_app

__all__ = ["APIError", "build_app"]
