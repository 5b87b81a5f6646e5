"""Backends of the frontend: what the interpreter calls, and the runtime and OpenAI-compatible servers that answer."""
