"""The runtime process: ZeroMQ transport, RuntimeCore (the one facade), detokenizer, Engine."""
