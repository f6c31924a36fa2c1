"""Models cut into shards and sized: sharding, memory budgets, the planner, the Hugging Face adapters."""
