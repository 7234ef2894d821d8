"""Command lines of the runtime: `generate` and `chat` (`serve` lives in runtime.serve)."""
