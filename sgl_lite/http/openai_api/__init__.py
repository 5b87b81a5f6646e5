"""The OpenAI-compatible routes: chat and completions, tools and their parsers, logprobs."""
