"""CPU-host tuning of the executor: the thread governor, run-queue reads, huge pages."""
