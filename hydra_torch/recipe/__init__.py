"""How a task trains: optimizers, parameter groups, learning-rate schedules."""
