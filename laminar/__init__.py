"""Laminar: asynchronous RL post-training runtime."""
