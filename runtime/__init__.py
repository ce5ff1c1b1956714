"""What every command shares to run the lesson's models: checkpoints (atomic saves, safe loads),
the device and what it can do, the CPU's faster kernels, profiling a round's cost, and the
settings with their presets and flag checks."""
