"""Serving: the Ray Serve app with an OpenAI-compatible API over continuous batching."""
