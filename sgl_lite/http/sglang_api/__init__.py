"""SGLang's native routes: /generate, /tokenize, and the worker routes sglang-router calls."""
