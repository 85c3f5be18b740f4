"""The commands, a module per group; ``rollout_capture.cli.app`` registers them in the help's order."""
