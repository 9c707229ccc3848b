"""RL objective and asynchronous actor loop (to come)."""
