"""Environments agents act in: sandboxes that hold their state across RL iterations, and the tools
(shell, Python, files, document search) whose calls and results become trajectory messages."""
