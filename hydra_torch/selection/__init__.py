"""Choosing models inside a run: rules that stop the worse tasks early, and tasks joining a running call."""
