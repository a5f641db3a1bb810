"""How a model is spread: the parallelism objects, the memory plan, memory accounting, precision."""
