"""What every command needs under the lesson's models, and nothing of them: checkpoints (atomic
saves, safe loads), the device and what it can do, the CPU's faster kernels, what a forward costs
here, the flags' checks and settings written once."""
