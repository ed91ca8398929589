"""Plugin tasks: declarations (config, entry points, built-ins), schedules, context."""
