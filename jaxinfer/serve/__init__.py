"""Serving: the OpenAI-compatible API (`python -m jaxinfer.serve`), its metrics, and OpenAI batch files."""
