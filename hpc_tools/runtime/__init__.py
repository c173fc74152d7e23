"""What runs inside the job, on every rank: environment, signals, hang watchdog, backend dispatch."""
