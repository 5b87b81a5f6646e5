"""Scheduling: the request record, queue policies, admission budgets, preemption, validation, stop checks, the step loop."""
