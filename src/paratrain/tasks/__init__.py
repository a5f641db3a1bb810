"""What is trained: the Task protocol, the registry of tasks by name, and the tasks themselves."""
