"""A run: the device workers, each task's runner unit by unit, and a task's life on the engines."""
