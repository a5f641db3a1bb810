"""What is trained: the Task contract (base.py), the tasks themselves (a module each, a folder per
family: preference/, embedding/, rl/) and their shared pieces (finetuning.py, lora.py). Which
task a config trains is decided by the registry, config/registry.py."""
