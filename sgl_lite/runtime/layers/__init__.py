"""Model building blocks: attention backends (torch reference, FlashInfer)."""
