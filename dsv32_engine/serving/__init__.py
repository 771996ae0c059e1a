"""A small continuous-batching decode loop that drives models through the planner."""
