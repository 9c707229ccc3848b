"""Sandboxed coding environments with test-based rewards (to come)."""
