"""Model execution: weight loading, the forward batch and its runner, tensor parallelism."""
