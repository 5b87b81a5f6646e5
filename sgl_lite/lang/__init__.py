"""The frontend language: IR, interpreter, select scoring, chat templates, RuntimeEndpoint. Torch-free."""
