"""Who this process is and how workers start: launcher environments, nodes, stop signals,
the stall watchdog."""
