"""What must outlive a run or survive its interruption: checkpoints, each task's random streams, signals."""
